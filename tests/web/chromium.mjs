// Headless Debian Chromium as the browser tests launch it (puppeteer-core,
// over CDP): off the network beyond loopback, audio that plays without a
// gesture, and a fake microphone that needs no prompt.
import puppeteer from "puppeteer-core";
import { join } from "node:path";

export function launchChromium(dir, extraArgs = []) {
  return puppeteer.launch({
    browser: "chrome",
    executablePath: process.env.CHROMIUM ?? "/usr/bin/chromium",
    headless: true,
    userDataDir: join(dir, "profile"),
    args: [
      "--no-sandbox",
      "--disable-gpu",
      "--disable-quic",
      "--no-first-run",
      "--disable-background-networking",
      "--disable-component-update",
      "--disable-sync",
      "--autoplay-policy=no-user-gesture-required",
      "--use-fake-ui-for-media-stream",
      "--use-fake-device-for-media-stream",
      ...extraArgs,
    ],
    defaultViewport: { width: 900, height: 760 },
  });
}
