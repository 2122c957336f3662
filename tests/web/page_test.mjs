// Drives the demo page in a real headless browser:
//   BROWSER=chromium|firefox node page_test.mjs URL [PROMPT]
// (URL may carry ?transport=websocket to skip the default WebRTC call.)
// Debian's Chromium is driven over CDP and Debian's Firefox ESR over WebDriver
// BiDi, both through puppeteer-core (one driver that speaks both; Playwright's
// Firefox needs its own patched build or a newer Firefox than ESR).
// Loads the page, asks PROMPT, waits for the answer's audio to start playing
// and its TTFP to show, lets the turn finish, then asks again and presses
// Stop. Writes a screenshot to a temp folder and prints one JSON object on
// stdout (exit 1 with {"error": ...} when a step fails).
import puppeteer from "puppeteer-core";
import { mkdtempSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";

const url = process.argv[2];
const prompt = process.argv[3] ?? "What do bees make?";
const browserName = process.env.BROWSER ?? "chromium";
const timeout = Number(process.env.PAGE_TEST_TIMEOUT_MS ?? 240000);
if (!url || !["chromium", "firefox"].includes(browserName)) {
  console.error("usage: BROWSER=chromium|firefox node page_test.mjs URL [PROMPT]");
  process.exit(2);
}

const dir = mkdtempSync(join(tmpdir(), "omnistream-page-"));
const screenshot = join(dir, "page.png");
const consoleErrors = [];
const result = { url, browser: browserName, screenshot };

const launch = {
  chromium: () =>
    puppeteer.launch({
      browser: "chrome",
      executablePath: process.env.CHROMIUM ?? "/usr/bin/chromium",
      headless: true,
      userDataDir: join(dir, "profile"),
      // The machine has no network beyond loopback: keep Chromium off it.
      args: [
        "--no-sandbox",
        "--disable-gpu",
        "--disable-quic",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--autoplay-policy=no-user-gesture-required",
        // The WebRTC call asks for the microphone: a fake device, no prompt.
        "--use-fake-ui-for-media-stream",
        "--use-fake-device-for-media-stream",
      ],
      defaultViewport: { width: 900, height: 760 },
    }),
  firefox: () =>
    puppeteer.launch({
      browser: "firefox",
      executablePath: process.env.FIREFOX ?? "/usr/bin/firefox-esr",
      headless: true,
      userDataDir: join(dir, "profile"),
      extraPrefsFirefox: {
        "media.autoplay.default": 0,
        "media.autoplay.block-webaudio": false,
        // No sound card here: a mock audio backend lets the AudioContext run.
        "media.cubeb.force_mock_context": true,
        "app.update.enabled": false,
        "browser.shell.checkDefaultBrowser": false,
        "network.connectivity-service.enabled": false,
        // The WebRTC call asks for the microphone: a fake device, no prompt.
        "media.navigator.streams.fake": true,
        "media.navigator.permission.disabled": true,
      },
      defaultViewport: { width: 900, height: 760 },
    }),
};

const browser = await launch[browserName]();
const stats = (page) => page.evaluate(() => JSON.parse(JSON.stringify(window.omnistreamStats)));
const waitFor = (page, fn, ms = timeout) => page.waitForFunction(fn, { timeout: ms, polling: 100 });
const text = (page, sel) => page.$eval(sel, (el) => el.textContent);

async function ask(page, message) {
  await page.$eval("#message", (el) => (el.value = ""));
  await page.type("#message", message);
  await page.click("#send");
}

try {
  const page = (await browser.pages())[0] ?? (await browser.newPage());
  page.on("console", (m) => {
    if (m.type() === "error") consoleErrors.push(m.text());
  });
  page.on("pageerror", (e) => consoleErrors.push(String(e)));

  const resp = await page.goto(url, { waitUntil: "load" });
  result.status = resp ? resp.status() : null;
  result.title = await page.title();
  result.user_agent = await page.evaluate(() => navigator.userAgent);
  // The controls carry the accessible names a screen-reader user would hear.
  result.labels = await page.evaluate(() => ({
    message: document.querySelector("#message")?.labels?.[0]?.textContent.trim(),
    send: document.querySelector("#send")?.textContent.trim(),
    stop: document.querySelector("#stop")?.textContent.trim(),
  }));

  // Turn 1.
  await ask(page, prompt);
  await waitFor(page, () => {
    const t = window.omnistreamStats?.turns?.[0];
    return t && (t.audio_started || t.status !== "in_progress");
  });
  await waitFor(page, () => {
    const el = document.querySelector("#log .assistant .ttfp");
    return el && /\d+ ms/.test(el.textContent);
  });
  result.ttfp_shown = await text(page, "#log .assistant .ttfp");
  result.ttft_shown = await text(page, "#log .assistant .ttft");
  await waitFor(page, () => window.omnistreamStats.turns[0].status !== "in_progress");
  // Let the scheduled audio play on a little, to see the audio clock run.
  await new Promise((r) => setTimeout(r, 1000));
  result.after_first = await stats(page);
  result.status_text = await text(page, "#status");

  // Turn 2: Stop as soon as the answer starts; the server must cancel it.
  await ask(page, "Tell me a long story about the sea and the ships on it.");
  await waitFor(page, () => {
    const t = window.omnistreamStats?.turns?.[1];
    return t && (t.ttft_ms !== null || t.audio_started || t.status !== "in_progress");
  });
  await page.click("#stop");
  await waitFor(page, () => window.omnistreamStats.turns[1].status !== "in_progress", 30000);

  await page.screenshot({ path: screenshot });
  result.stats = await stats(page);
  result.console_errors = consoleErrors;
  console.log(JSON.stringify(result));
  await browser.close();
} catch (e) {
  result.error = String(e && e.stack ? e.stack : e);
  result.console_errors = consoleErrors;
  try {
    const page = (await browser.pages())[0];
    if (page) {
      await page.screenshot({ path: screenshot });
      result.stats = await stats(page);
    }
  } catch (_) {
    // The page is gone; report what we have.
  }
  console.log(JSON.stringify(result));
  await browser.close().catch(() => {});
  process.exit(1);
}
