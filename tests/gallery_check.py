#!/usr/bin/env python3
"""Opens the sampler's gallery (samples/index.html, from disk) in headless Chromium and checks
what a user sees, driving Chromium over the DevTools protocol (--remote-debugging-pipe: JSON
messages on fds 3 and 4, each ended by a NUL byte). Standard library only.

    gallery_check.py --chromium=PATH --gallery=DIR/samples/index.html --screenshot=OUT.png \
        --first=STEP --then=STEP --ready=FILE

1. Loads the page and waits until it shows checkpoint --first with every image loaded.
2. Creates --ready (the test then makes the sampler render checkpoint --then).
3. Waits, without reloading, until the same page shows --then with every image loaded too.
4. Saves a screenshot to --screenshot and prints what the page says, and the run's curves it
   plots (each chart's lines and their points).
Exits 0 when all of that holds, 1 with the reason otherwise.
"""
import argparse
import base64
import json
import os
import subprocess
import sys
import time


class Chromium:
    def __init__(self, binary):
        to_child_r, self.to_child = os.pipe()
        self.from_child, from_child_w = os.pipe()
        # The child's fds 3 (commands in) and 4 (replies out), put in place by the shell that
        # execs it (subprocess keeps only pass_fds open, at their own numbers).
        command = [binary, "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
                   "--remote-debugging-pipe", "--window-size=1200,900", "about:blank"]
        log = open(os.environ.get("GALLERY_CHROMIUM_LOG", os.devnull), "w")
        self.process = subprocess.Popen(
            ["/bin/sh", "-c", f'exec "$@" 3<&{to_child_r} 4>&{from_child_w}', "sh"] + command,
            pass_fds=(to_child_r, from_child_w), stdout=subprocess.DEVNULL, stderr=log)
        os.close(to_child_r)
        os.close(from_child_w)
        self.buffer = b""
        self.next_id = 0
        self.session = None

    def call(self, method, params=None, session=True, timeout=30):
        self.next_id += 1
        message = {"id": self.next_id, "method": method, "params": params or {}}
        if session and self.session:
            message["sessionId"] = self.session
        os.write(self.to_child, json.dumps(message).encode() + b"\0")
        deadline = time.time() + timeout
        while time.time() < deadline:
            while b"\0" not in self.buffer:
                chunk = os.read(self.from_child, 1 << 16)
                if not chunk:
                    raise RuntimeError(f"chromium closed the pipe during {method}")
                self.buffer += chunk
            raw, self.buffer = self.buffer.split(b"\0", 1)
            reply = json.loads(raw)
            if reply.get("id") == self.next_id:
                if "error" in reply:
                    raise RuntimeError(f"{method}: {reply['error']}")
                return reply.get("result", {})
        raise RuntimeError(f"{method}: no reply in {timeout} s")

    def attach(self):
        targets = self.call("Target.getTargets", session=False)["targetInfos"]
        page = next(t for t in targets if t["type"] == "page")
        self.session = self.call("Target.attachToTarget",
                                 {"targetId": page["targetId"], "flatten": True},
                                 session=False)["sessionId"]

    def evaluate(self, expression):
        result = self.call("Runtime.evaluate", {"expression": expression, "returnByValue": True})
        return result.get("result", {}).get("value")

    def close(self):
        self.process.kill()
        self.process.wait()


# What the page shows: for each checkpoint row, its image count and how many have loaded; the
# status line; and a marker set once per page load (a reload would change it).
STATE = """(() => {
  if (!window.__loadMarker) window.__loadMarker = String(Math.random());
  const rows = {};
  for (const tr of document.querySelectorAll('#grid tr[id^=step-]')) {
    const imgs = tr.querySelectorAll('img');
    const loaded = [...imgs].filter(i => i.dataset.loaded && i.naturalWidth > 0).length;
    rows[tr.id.slice(5)] = [imgs.length, loaded];
  }
  const curves = [...document.querySelectorAll('#curves svg')].map(svg => ({
    title: svg.dataset.title,
    lines: Object.fromEntries([...svg.querySelectorAll('polyline')].map(
        p => [p.dataset.series, p.getAttribute('points').split(' ').length]))}));
  return {rows, curves, status: document.getElementById('status').textContent,
          marker: window.__loadMarker};
})()"""


def wait_for(chrome, step, seconds):
    deadline = time.time() + seconds
    state = None
    while time.time() < deadline:
        state = chrome.evaluate(STATE)
        row = (state or {}).get("rows", {}).get(str(step))
        if row and row[0] > 0 and row[0] == row[1]:
            return state
        time.sleep(0.2)
    raise RuntimeError(f"the page never showed step {step} with all its images: {state}")


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--chromium", required=True)
    parser.add_argument("--gallery", required=True)
    parser.add_argument("--screenshot", required=True)
    parser.add_argument("--first", type=int, required=True)
    parser.add_argument("--then", type=int, required=True)
    parser.add_argument("--ready", required=True)
    parser.add_argument("--timeout", type=float, default=120)
    args = parser.parse_args()
    chrome = Chromium(args.chromium)
    try:
        chrome.attach()
        chrome.call("Page.enable")
        chrome.call("Page.navigate", {"url": "file://" + os.path.abspath(args.gallery)})
        first = wait_for(chrome, args.first, args.timeout)
        print(f"page load: {first['status']}; rows {first['rows']}")
        open(args.ready, "w").close()
        then = wait_for(chrome, args.then, args.timeout)
        if then["marker"] != first["marker"]:
            raise RuntimeError("the page reloaded to show the new checkpoint")
        if str(args.first) not in then["rows"]:
            raise RuntimeError(f"step {args.first} went missing: {then['rows']}")
        print(f"without a reload: {then['status']}; rows {then['rows']}")
        # The run's curves, where the run folder has them: each chart, and how many points each
        # of its lines has.
        curves = "; ".join(
            f"{c['title']}: " + ", ".join(f"{k} {n}" for k, n in sorted(c["lines"].items()))
            for c in then["curves"])
        print(f"curves: {curves or 'none'}")
        shot = chrome.call("Page.captureScreenshot", {"format": "png"})["data"]
        os.makedirs(os.path.dirname(os.path.abspath(args.screenshot)), exist_ok=True)
        with open(args.screenshot, "wb") as f:
            f.write(base64.b64decode(shot))
        print(f"screenshot: {args.screenshot}")
    except (RuntimeError, StopIteration, OSError, ValueError) as e:
        print(f"gallery check failed: {e}", file=sys.stderr)
        return 1
    finally:
        chrome.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
