#!/usr/bin/env python3
"""Drives the built-in chat page (`GET /`) of a running `torus-wgpu serve` in headless Chromium.

Usage: python3 tests/webui_selenium.py BASE_URL SCREENSHOT_PATH [--api-key KEY]

BASE_URL is the page's URL, e.g. http://127.0.0.1:8000/ (or a path prefix behind a proxy, such
as http://host/torus/). With --api-key, the page must first ask for the key (the server
answers 401 without one). Checks: the model name shows; a question's reply streams (text seen
before the end of the stream), ends with a `.stats` line "N tokens, X.X tok/s" and is not
empty; a screenshot is written; the page's Markdown renderer escapes HTML; the browser console
has no SEVERE entries (with --api-key: apart from Chrome's own network entry for the
model list's expected 401). Needs selenium 4 and Chromium with chromedriver (Debian: chromium,
chromium-driver). Prints `webui: all checks passed` and exits 0, or prints what failed (with the
page source, truncated) and exits 1.
"""

import argparse
import os
import re
import sys
import time

from selenium import webdriver
from selenium.webdriver.chrome.options import Options
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By
from selenium.webdriver.support import expected_conditions as EC
from selenium.webdriver.support.ui import WebDriverWait

QUESTION = "What is the capital of France?"
STATS_RE = re.compile(r"\d+ tokens, [\d.]+ tok/s")


class Failure(Exception):
    pass


def check(cond, what):
    if not cond:
        raise Failure(what)


def make_driver():
    options = Options()
    for a in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--window-size=1200,900"):
        options.add_argument(a)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    if os.path.exists("/usr/bin/chromium"):
        options.binary_location = "/usr/bin/chromium"
    if os.path.exists("/usr/bin/chromedriver"):
        return webdriver.Chrome(service=Service("/usr/bin/chromedriver"), options=options)
    return webdriver.Chrome(options=options)


def set_value(driver, element_id, value):
    el = driver.find_element(By.ID, element_id)
    el.clear()
    el.send_keys(value)
    check(el.get_attribute("value") == value, f"#{element_id} holds {el.get_attribute('value')!r}, not {value!r}")


def run(driver, args):
    driver.get(args.base_url)

    if args.api_key is not None:
        key = WebDriverWait(driver, 30).until(EC.visibility_of_element_located((By.ID, "api-key")))
        key.send_keys(args.api_key)
        driver.find_element(By.ID, "api-key-save").click()

    try:
        WebDriverWait(driver, 60).until(lambda d: d.find_element(By.ID, "model-name").text.strip())
    except Exception:
        raise Failure("the model name did not show within 60 s")
    model = driver.find_element(By.ID, "model-name").text.strip()
    print(f"webui: model {model!r}")

    # The settings panel may be folded (narrow windows): open it so its inputs are interactable.
    settings = driver.find_element(By.ID, "settings")
    if settings.get_attribute("open") is None:
        settings.find_element(By.TAG_NAME, "summary").click()
    set_value(driver, "max-tokens", "24")
    set_value(driver, "temperature", "0")

    n_before = len(driver.find_elements(By.CSS_SELECTOR, ".assistant"))
    # Also watch from inside the page (WebDriver polling can miss a fast stream): the newest
    # reply's text as each rendering task leaves it, noted while it has no stats line yet.
    driver.execute_script(
        "window.__partials = [];"
        "new MutationObserver(() => {"
        "  const r = document.querySelectorAll('.assistant');"
        "  if (r.length <= arguments[0]) return;"
        "  const last = r[r.length - 1], body = last.querySelector('.body');"
        "  if (!last.querySelector('.stats') && body && body.textContent.trim()) window.__partials.push(body.textContent);"
        "}).observe(document.getElementById('messages'), {subtree: true, childList: true, characterData: true});",
        n_before,
    )
    driver.find_element(By.ID, "input").send_keys(QUESTION)
    driver.find_element(By.ID, "send").click()

    # Poll the reply as it streams: it must show text before its stats line appears.
    deadline = time.monotonic() + 120
    seen_partial = False
    stats_text = None
    reply = None
    while time.monotonic() < deadline:
        replies = driver.find_elements(By.CSS_SELECTOR, ".assistant")
        if len(replies) > n_before:
            reply = replies[-1]
            stats = reply.find_elements(By.CSS_SELECTOR, ".stats")
            if stats:
                stats_text = stats[0].text.strip()
                break
            if reply.find_element(By.CSS_SELECTOR, ".body").text.strip():
                seen_partial = True
        time.sleep(0.02)
    check(reply is not None, "no .assistant reply element appeared")
    check(stats_text is not None, "no .stats line under the reply within 120 s")
    print(f"webui: stats {stats_text!r}")
    check(STATS_RE.search(stats_text), f"stats line {stats_text!r} does not match {STATS_RE.pattern!r}")
    partials = driver.execute_script("return window.__partials;") or []
    print(f"webui: reply text seen before the end: polled {seen_partial}, in page {len(partials)} time(s)")
    check(seen_partial or partials, "the reply's text was never seen before the stream ended (not streamed?)")
    errors = reply.find_elements(By.CSS_SELECTOR, ".error")
    check(not errors, f"the reply shows an error: {errors[0].text if errors else ''!r}")
    text = reply.find_element(By.CSS_SELECTOR, ".body").text.strip()
    print(f"webui: reply {text!r}")
    check(text, "the reply is empty")
    users = driver.find_elements(By.CSS_SELECTOR, ".user")
    check(users and users[-1].text.strip() == QUESTION, "the question is not shown as a .user message")

    # Model text is untrusted: the renderer escapes HTML before adding its own markup.
    html = driver.execute_script("return window.renderMarkdown(arguments[0]);", "<img src=x onerror=alert(1)>")
    check(isinstance(html, str) and "&lt;img" in html, f"renderMarkdown did not escape the tag: {html!r}")
    has_img = driver.execute_script(
        "const d = document.createElement('div'); d.innerHTML = arguments[0];"
        "return d.querySelector('img, script, [onerror]') !== null;",
        html,
    )
    check(not has_img and "<img" not in html, f"renderMarkdown output holds an element from model text: {html!r}")
    link = driver.execute_script(
        "return window.renderMarkdown(arguments[0]);", "[a](javascript:alert(1)) [b](https://example.com/)"
    )
    check('href="javascript' not in link, f"renderMarkdown made a javascript: link: {link!r}")
    check('rel="noopener noreferrer"' in link, f"an http(s) link lacks rel=noopener noreferrer: {link!r}")

    driver.save_screenshot(args.screenshot)
    check(os.path.isfile(args.screenshot) and os.path.getsize(args.screenshot) > 0,
          f"no screenshot at {args.screenshot}")

    severe = []
    for e in driver.get_log("browser"):
        if e.get("level") != "SEVERE":
            continue
        msg = str(e.get("message"))
        # Chrome itself logs every 401 response ("Failed to load resource"); with a key, the
        # first model list's 401 is what makes the page ask for it: expected, nothing else is.
        if args.api_key is not None and e.get("source") == "network" and "/v1/models" in msg and "status of 401" in msg:
            print(f"webui: expected console entry: {msg}")
            continue
        severe.append(e)
    check(not severe, "SEVERE browser console entries: " + "; ".join(str(e.get("message")) for e in severe))


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("base_url")
    p.add_argument("screenshot")
    p.add_argument("--api-key")
    args = p.parse_args()

    driver = make_driver()
    try:
        try:
            run(driver, args)
        except Exception as e:  # Failure, or a selenium error (element missing, timeout)
            what = str(e) if isinstance(e, Failure) else f"{type(e).__name__}: {e}"
            print(f"webui: FAILED: {what}")
            try:
                source = driver.page_source
                print("webui: page source (truncated):\n" + source[:4000])
            except Exception:
                pass
            return 1
    finally:
        driver.quit()
    print("webui: all checks passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
