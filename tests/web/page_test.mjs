// Drives the demo page in headless Debian Chromium:
//   node page_test.mjs URL [PROMPT]
// Loads the page, asks PROMPT, waits for the answer's audio to start playing
// and its TTFP to show, lets the turn finish, then asks again and presses
// Stop. Writes a screenshot to a temp folder and prints one JSON object on
// stdout (exit 1 with {"error": ...} when a step fails).
import { chromium } from "playwright-core";
import { mkdtempSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";

const url = process.argv[2];
const prompt = process.argv[3] ?? "What do bees make?";
const timeout = Number(process.env.PAGE_TEST_TIMEOUT_MS ?? 240000);
if (!url) {
  console.error("usage: node page_test.mjs URL [PROMPT]");
  process.exit(2);
}

const dir = mkdtempSync(join(tmpdir(), "omnistream-page-"));
const screenshot = join(dir, "page.png");
const consoleErrors = [];
const result = { url, screenshot };

const context = await chromium.launchPersistentContext(join(dir, "profile"), {
  executablePath: process.env.CHROMIUM ?? "/usr/bin/chromium",
  headless: true,
  args: [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--autoplay-policy=no-user-gesture-required",
  ],
  viewport: { width: 900, height: 760 },
});

const stats = (page) => page.evaluate(() => JSON.parse(JSON.stringify(window.omnistreamStats)));

try {
  const page = context.pages()[0] ?? (await context.newPage());
  page.on("console", (m) => {
    if (m.type() === "error") consoleErrors.push(m.text());
  });
  page.on("pageerror", (e) => consoleErrors.push(String(e)));

  const resp = await page.goto(url, { waitUntil: "load" });
  result.status = resp ? resp.status() : null;
  result.title = await page.title();

  // Turn 1: by the accessible names, as a screen-reader user would.
  await page.getByLabel("Message").fill(prompt);
  await page.getByRole("button", { name: "Send" }).click();
  await page.waitForFunction(
    () => {
      const t = window.omnistreamStats?.turns?.[0];
      return t && (t.audio_started || t.status !== "in_progress");
    },
    null,
    { timeout },
  );
  const ttfp = page.locator("#log .assistant").first().locator(".ttfp");
  await page.waitForFunction((el) => /\d+ ms/.test(el.textContent), await ttfp.elementHandle(), { timeout });
  result.ttfp_shown = await ttfp.textContent();
  result.ttft_shown = await page.locator("#log .assistant").first().locator(".ttft").textContent();
  await page.waitForFunction(() => window.omnistreamStats.turns[0].status !== "in_progress", null, { timeout });
  // Let the scheduled audio play on a little, to see the audio clock run.
  await page.waitForTimeout(1000);
  result.after_first = await stats(page);

  // Turn 2: Stop as soon as the answer starts; the server must cancel it.
  await page.getByLabel("Message").fill("Tell me a long story about the sea and the ships on it.");
  await page.getByRole("button", { name: "Send" }).click();
  await page.waitForFunction(
    () => {
      const t = window.omnistreamStats?.turns?.[1];
      return t && (t.ttft_ms !== null || t.audio_started || t.status !== "in_progress");
    },
    null,
    { timeout },
  );
  await page.getByRole("button", { name: "Stop" }).click();
  await page.waitForFunction(() => window.omnistreamStats.turns[1].status !== "in_progress", null, { timeout: 30000 });

  await page.screenshot({ path: screenshot });
  result.stats = await stats(page);
  result.console_errors = consoleErrors;
  console.log(JSON.stringify(result));
  await context.close();
} catch (e) {
  result.error = String(e && e.stack ? e.stack : e);
  result.console_errors = consoleErrors;
  try {
    const page = context.pages()[0];
    if (page) {
      await page.screenshot({ path: screenshot });
      result.stats = await stats(page);
    }
  } catch (_) {
    // The page is gone; report what we have.
  }
  console.log(JSON.stringify(result));
  await context.close().catch(() => {});
  process.exit(1);
}
