"""The playground page at `/` (src/unmask/web/), driven in real headless Chromium (Debian's chromium and
chromium-driver, installed by `make setup`) against a real `unmask serve` with the built-in model and an API key.

Set PLAYGROUND_SCREENSHOTS=DIR to keep the screenshots the tests take (docs/playground*.png came from
`PLAYGROUND_SCREENSHOTS=docs pytest tests/test_playground.py`).
"""
from __future__ import annotations

import http.client
import json
import os
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import pytest

from test_server import Server, free_port

BUILT_IN = Path(__file__).resolve().parents[1] / "src" / "unmask" / "assets" / "unmask-tiny"
CHROMIUM, CHROMEDRIVER = "/usr/bin/chromium", "/usr/bin/chromedriver"
KEY = "playground-key"

webdriver = pytest.importorskip("selenium.webdriver", reason="selenium is not installed (pip install -e '.[test]')")
if not (os.access(CHROMIUM, os.X_OK) and os.access(CHROMEDRIVER, os.X_OK)):
    pytest.skip(f"{CHROMIUM} / {CHROMEDRIVER} not installed (make setup installs Debian's chromium and "
                "chromium-driver as root)", allow_module_level=True)

from selenium.common.exceptions import TimeoutException  # noqa: E402
from selenium.webdriver.common.by import By  # noqa: E402
from selenium.webdriver.common.keys import Keys  # noqa: E402
from selenium.webdriver.support.ui import WebDriverWait  # noqa: E402

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    s = Server(BUILT_IN, tmp_path_factory.mktemp("playground") / "server.log", "--api-key", KEY).wait_ready()
    yield s
    s.stop()


@pytest.fixture(scope="module")
def driver():
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                "--window-size=1200,900", "--disable-extensions"):
        options.add_argument(arg)
    d = webdriver.Chrome(service=webdriver.ChromeService(executable_path=CHROMEDRIVER), options=options)
    yield d
    d.quit()


def wait(driver, cond, timeout: float = 30, what: str = ""):
    try:
        return WebDriverWait(driver, timeout, poll_frequency=0.05).until(lambda d: cond(d))
    except TimeoutException:
        logs = driver.get_log("browser") if hasattr(driver, "get_log") else []
        pytest.fail(f"timed out waiting for {what}; browser log: {logs}")


def screenshot(driver, name: str, tmp_path: Path) -> None:
    out = Path(os.environ.get("PLAYGROUND_SCREENSHOTS") or tmp_path)
    out.mkdir(parents=True, exist_ok=True)
    driver.save_screenshot(str(out / f"{name}.png"))


def open_page(driver, server, key: str | None = KEY):
    """Loads `/` with `key` already in local storage (None: no key stored), models listed."""
    driver.get(server.url + "/")
    driver.execute_script("localStorage.clear();" + (f"localStorage.setItem('unmask.apiKey', '{key}');" if key else ""))
    driver.get(server.url + "/")
    if key:
        wait(driver, lambda d: d.find_element(By.ID, "status").text == "ready", what="the model list")


def set_field(driver, element_id: str, value: str) -> None:
    el = driver.find_element(By.ID, element_id)
    driver.execute_script("arguments[0].value = arguments[1]; arguments[0].dispatchEvent(new Event('input'));",
                          el, value)


def api(server, path: str, body: dict) -> dict:
    r = httpx.post(server.url + path, json=body, headers={"Authorization": f"Bearer {KEY}"}, timeout=60)
    r.raise_for_status()
    return r.json()


def send(driver, text: str) -> None:
    box = driver.find_element(By.ID, "input")
    box.clear()
    box.send_keys(text)
    driver.find_element(By.ID, "send").click()


# what the page showed while the answer streamed, mutation by mutation: the answer's text, and the token states
# of the denoising view (read back by the tests)
WATCH_FRAMES = """
window.__frames = []; window.__shown = [];
new MutationObserver(() => {
  const b = document.querySelector('.msg.assistant:last-of-type .body');
  if (b && !b.closest('[data-done]')) window.__shown.push(b.textContent);
  const f = document.querySelector('.msg.assistant:last-of-type .frame, #fim-out .frame');
  if (f && f.childNodes.length) window.__frames.push({
    mask: f.querySelectorAll('.tok-mask').length, fresh: f.querySelectorAll('.tok-new').length,
    settled: f.querySelectorAll('.tok-settled').length, masked: f.dataset.masked});
}).observe(document.body, {subtree: true, childList: true});
"""


# every frame the page draws, as drawn: (class, text) of the denoising view's spans after each renderFrame call
WATCH_RENDERS = """
window.__rendered = [];
const draw = window.renderFrame;
window.renderFrame = (container, frame) => {
  draw(container, frame);
  window.__rendered.push([...container.children].map((c) => [c.className, c.textContent]));
};
"""
# the request bodies the page sends
WATCH_REQUESTS = """
window.__bodies = [];
const send = window.fetch;
window.fetch = (url, options = {}) => {
  if (options.body) window.__bodies.push(JSON.parse(options.body));
  return send(url, options);
};
"""


def stream_frames(server, path: str, body: dict) -> list[dict]:
    """The `diffusing` frames of choice 0 of a streamed request, read over HTTP."""
    frames = []
    with httpx.stream("POST", server.url + path, json={**body, "stream": True, "diffusing": True},
                      headers={"Authorization": f"Bearer {KEY}"}, timeout=60) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if line.startswith("data: {"):
                chunk = json.loads(line[6:])
                if chunk.get("diffusing", {}).get("index") == 0:
                    frames.append(chunk["diffusing"])
    return frames


def test_page_is_served_without_a_key_and_asks_for_it_on_a_401(server, driver, tmp_path):
    for path, kind in (("/", "text/html"), ("/playground/app.js", "text/javascript"),
                       ("/playground/style.css", "text/css")):
        r = httpx.get(server.url + path, timeout=10)
        assert r.status_code == 200 and r.headers["content-type"].startswith(kind), path
    r = httpx.get(server.url + "/playground/other.js", timeout=10)   # anything else: the key, then the 404
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    r = httpx.post(server.url + "/", timeout=10)
    assert r.status_code == 405 and r.json()["error"]["code"] == "method_not_allowed"

    open_page(driver, server, key=None)
    dialog = driver.find_element(By.ID, "key-dialog")
    wait(driver, lambda d: dialog.get_attribute("open") is not None, what="the key dialog")
    driver.find_element(By.ID, "key-input").send_keys(KEY)
    driver.find_element(By.ID, "key-ok").click()
    wait(driver, lambda d: d.find_element(By.ID, "status").text == "ready", what="the models after the key")
    assert driver.execute_script("return localStorage.getItem('unmask.apiKey')") == KEY
    models = [o.get_attribute("value") for o in driver.find_elements(By.CSS_SELECTOR, "#set-model option")]
    assert models == ["unmask-tiny"]
    driver.refresh()   # kept: no second prompt
    wait(driver, lambda d: d.find_element(By.ID, "status").text == "ready", what="the models on reload")
    assert driver.find_element(By.ID, "key-dialog").get_attribute("open") is None


def test_chat_streams_the_greedy_answer_and_the_denoising_view(server, driver, tmp_path):
    open_page(driver, server)
    set_field(driver, "set-max-tokens", "24")
    set_field(driver, "system", "You are terse.")
    driver.execute_script(WATCH_FRAMES)
    send(driver, "What is a list in Python?")
    msg = wait(driver, lambda d: d.find_element(By.CSS_SELECTOR, ".msg.assistant[data-done]"), what="the answer")
    screenshot(driver, "playground", tmp_path)

    want = api(server, "/v1/chat/completions", {
        "model": "unmask-tiny", "max_tokens": 24, "temperature": 0,
        "messages": [{"role": "system", "content": "You are terse."},
                     {"role": "user", "content": "What is a list in Python?"}]})["choices"][0]["message"]["content"]
    assert want.strip()
    assert msg.get_attribute("data-text") == want
    text = " ".join(msg.find_element(By.CSS_SELECTOR, ".body").text.split())
    assert text and all(w.strip("*_`#") in text for w in want.split() if w.strip("*_`#")), (text, want)

    shown = [t for t in dict.fromkeys(driver.execute_script("return window.__shown")) if t]
    assert len(shown) >= 2, shown          # the answer arrived in pieces, each extending the last
    assert all(b.startswith(a) for a, b in zip(shown, shown[1:])), shown
    frames = driver.execute_script("return window.__frames")
    assert len({tuple(sorted(f.items())) for f in frames}) > 2      # the view changed from frame to frame
    first_masked = next(i for i, f in enumerate(frames) if f["mask"] > 0)   # masks first ...
    assert any(f["fresh"] > 0 for f in frames[first_masked:])                # ... then newly committed tokens
    assert frames[-1]["mask"] == 0 and frames[-1]["masked"] == "0"            # the last frame: all committed
    stats = msg.find_element(By.CSS_SELECTOR, ".stats").get_attribute("textContent")
    assert "tokens/s" in stats and "forwards" in stats and "tokens/forward" in stats, stats

    # the conversation goes on with the history, and Reset clears it
    send(driver, "Thanks")
    wait(driver, lambda d: len(d.find_elements(By.CSS_SELECTOR, ".msg.assistant[data-done]")) == 2, what="turn 2")
    driver.find_element(By.ID, "reset").click()
    assert driver.find_elements(By.CSS_SELECTOR, "#messages .msg") == []


def test_stop_cancels_the_request_on_the_server(server, driver, tmp_path):
    open_page(driver, server)
    set_field(driver, "set-max-tokens", "1500")
    set_field(driver, "set-extra", '{"ignore_eos": true}')
    set_field(driver, "set-block", "32")      # a wide block: more of it masked in the screenshot
    before = server.metrics(KEY).get("unmask:request_cancellations_total", 0)
    send(driver, "Write a long story.")
    wait(driver, lambda d: len(d.find_element(By.CSS_SELECTOR, ".msg.assistant .body").text) > 80
         and d.find_elements(By.CSS_SELECTOR, ".msg.assistant .frame .tok-mask"), what="a frame with masks")
    screenshot(driver, "playground-denoising", tmp_path)
    driver.find_element(By.ID, "stop").click()
    wait(driver, lambda d: "Stopped." in d.find_element(By.CSS_SELECTOR, ".msg.assistant").text, what="Stopped.")
    deadline = time.monotonic() + 10
    while server.metrics(KEY).get("unmask:request_cancellations_total", 0) < before + 1:
        assert time.monotonic() < deadline, "the server counted no cancellation"
        time.sleep(0.05)
    assert driver.find_element(By.ID, "send").is_enabled() and not driver.find_element(By.ID, "stop").is_enabled()


def test_bad_extra_fields_show_the_servers_error(server, driver):
    open_page(driver, server)
    set_field(driver, "set-extra", '{"threshold": 7}')
    send(driver, "Hi")
    err = wait(driver, lambda d: d.find_element(By.CSS_SELECTOR, ".msg.assistant .error"), what="the error")
    assert err.text.startswith("Error: 400") and "threshold" in err.text


def test_fill_in_the_middle_highlights_the_infill(server, driver, tmp_path):
    open_page(driver, server)
    driver.find_element(By.ID, "tab-fim").click()
    set_field(driver, "set-max-tokens", "12")
    prefix, suffix = driver.find_element(By.ID, "fim-prefix").get_attribute("value"), \
        driver.find_element(By.ID, "fim-suffix").get_attribute("value")
    driver.find_element(By.ID, "send").click()
    out = wait(driver, lambda d: d.find_element(By.CSS_SELECTOR, "#fim-out[data-done]"), what="the infill")
    screenshot(driver, "playground-fim", tmp_path)
    want = api(server, "/v1/fim/completions", {"model": "unmask-tiny", "prompt": prefix, "suffix": suffix,
                                               "max_tokens": 12, "temperature": 0})["choices"][0]["text"]
    mark = out.find_element(By.CSS_SELECTOR, "mark.infill")
    assert mark.get_attribute("textContent") == want
    # highlighted by more than colour: outlined and underlined, on a background the prefix and suffix lack
    look = driver.execute_script("const s = getComputedStyle(arguments[0]), c = getComputedStyle(arguments[0].parentNode);"
                                 "return [s.outlineStyle, s.textDecorationStyle, s.backgroundColor, c.backgroundColor]",
                                 mark)
    assert look[0] == "solid" and look[1] == "wavy" and look[2] != look[3], look
    code = out.find_element(By.CSS_SELECTOR, "code").get_attribute("textContent")
    assert code == prefix + want + suffix


def test_json_mode_validates_the_answer_against_the_schema(server, driver, tmp_path):
    open_page(driver, server)
    driver.find_element(By.ID, "tab-json").click()
    set_field(driver, "set-max-tokens", "60")
    send(driver, "A person")
    wait(driver, lambda d: d.find_element(By.CSS_SELECTOR, "#json-out[data-done]"), what="the JSON answer")
    verdict = driver.find_element(By.ID, "json-valid")
    screenshot(driver, "playground-json", tmp_path)
    text = driver.find_element(By.CSS_SELECTOR, "#json-out code").get_attribute("textContent")
    # the grammar constrains the answer to the schema
    assert "good" in verdict.get_attribute("class") and verdict.text.startswith("✓"), (verdict.text, text)
    assert set(json.loads(text)) >= {"name", "age"}
    # the page's own validator reports a mismatch
    problems = driver.execute_script(
        "return validate({name: 3}, {type: 'object', properties: {name: {type: 'string'}, "
        "kind: {enum: ['a', 'b']}}, required: ['name', 'age']}, '$')")
    assert problems == ["$.age is missing", "$.name is integer, not string"]

    # an answer cut short by max_tokens is not JSON: the page says so
    set_field(driver, "set-max-tokens", "2")
    send(driver, "A person")
    wait(driver, lambda d: d.find_element(By.CSS_SELECTOR, "#json-out[data-done]"), what="the short answer")
    verdict = driver.find_element(By.ID, "json-valid")
    assert "bad" in verdict.get_attribute("class") and verdict.text.startswith("✗ Not valid JSON"), verdict.text


class PrefixProxy(ThreadingHTTPServer):
    """A reverse proxy serving `upstream` under `prefix`, which it strips (as nginx's `proxy_pass .../;`),
    relaying the answer as it arrives (the SSE streams too)."""

    daemon_threads = True

    def __init__(self, prefix: str, upstream_port: int):
        self.prefix, self.upstream_port = prefix, upstream_port
        super().__init__(("127.0.0.1", free_port()), self.Handler)
        threading.Thread(target=self.serve_forever, daemon=True).start()

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args):
            pass

        def relay(self):
            prefix = self.server.prefix
            if not self.path.startswith(prefix + "/"):
                self.send_error(404)
                return
            body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
            up = http.client.HTTPConnection("127.0.0.1", self.server.upstream_port, timeout=60)
            headers = {k: v for k, v in self.headers.items() if k.lower() not in ("host", "connection")}
            up.request(self.command, self.path[len(prefix):], body=body or None, headers=headers)
            resp = up.getresponse()
            self.send_response(resp.status)
            for k, v in resp.getheaders():
                if k.lower() not in ("transfer-encoding", "connection", "content-length"):
                    self.send_header(k, v)
            self.send_header("Transfer-Encoding", "chunked")
            self.send_header("Connection", "close")
            self.end_headers()
            try:
                while chunk := resp.read1(65536):
                    self.wfile.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
                    self.wfile.flush()
                self.wfile.write(b"0\r\n\r\n")
            except (BrokenPipeError, ConnectionResetError):
                pass                      # the browser went away (Stop)
            finally:
                up.close()                # and so does the server's client: it cancels the request
            self.close_connection = True

        do_GET = do_POST = relay


def test_the_page_works_behind_a_proxy_under_root_path(tmp_path, driver):
    s = Server(BUILT_IN, tmp_path / "server.log", "--api-key", KEY, "--root-path", "/unmask").wait_ready()
    proxy = PrefixProxy("/unmask", s.port)
    try:
        base = f"http://127.0.0.1:{proxy.server_address[1]}/unmask"
        driver.get(base + "/")
        driver.execute_script(f"localStorage.setItem('unmask.apiKey', '{KEY}');")
        driver.get(base + "/")
        wait(driver, lambda d: d.find_element(By.ID, "status").text == "ready", what="the models through the proxy")
        set_field(driver, "set-max-tokens", "8")
        send(driver, "Hi")
        msg = wait(driver, lambda d: d.find_element(By.CSS_SELECTOR, ".msg.assistant[data-done]"), what="the answer")
        assert msg.get_attribute("data-text") and not msg.find_elements(By.CSS_SELECTOR, ".error")
        assert httpx.get(base + "/health", timeout=10).status_code == 200    # still open under the prefix
        assert httpx.get(base + "/metrics", timeout=10).status_code == 401
    finally:
        proxy.shutdown()
        s.stop()


def test_markdown_rendering_escapes_html(server, driver):
    open_page(driver, server)
    html = driver.execute_script("return renderMarkdown(arguments[0])", (
        "# Title\n<img src=x onerror=alert(1)> **bold** and `a<b`\n\n- one\n- two\n\n"
        "```python\nif x < 1:\n    print('<b>')\n```\n[site](https://example.org) [js](javascript:alert(1))"))
    assert "<img" not in html and "&lt;img src=x onerror=alert(1)&gt;" in html
    assert "<h3>Title</h3>" in html and "<strong>bold</strong>" in html and "<code>a&lt;b</code>" in html
    assert "<ul><li>one</li><li>two</li></ul>" in html
    assert '<pre class="code" data-lang="python">' in html and "if x &lt; 1:\n    print(&#39;&lt;b&gt;&#39;)" in html
    assert '<a href="https://example.org"' in html and 'href="javascript' not in html


MASK = "\u2591"


def marked(frame: dict) -> dict:
    """What a frame marks, from its spans: the committed text, the edited text, the count of remasked positions."""
    chars = list(frame["text"])
    take = lambda spans, keep: "".join(chars[i] for a, b in spans for i in range(a, b) if keep(chars[i]))  # noqa: E731
    return {"new": take(frame["committed"], lambda c: c != MASK),
            "edit": take(frame["edited"], lambda c: c != MASK),
            "remask": len(take(frame["edited"], lambda c: c == MASK)), "text": frame["text"]}


def drawn(spans: list) -> dict:
    """The same, read from the spans the page drew."""
    text = lambda cls: "".join(t for c, t in spans if cls in c.split())  # noqa: E731
    return {"new": text("tok-new"), "edit": text("tok-edit"), "remask": len(text("tok-remask")),
            "text": "".join(t for _, t in spans)}


def test_edited_and_remasked_tokens_are_marked_from_the_frames(server, driver, tmp_path):
    """With an edit rule on (edit_threshold low, remask_budget), the page marks exactly the tokens each frame says
    were replaced or put back to mask, in styles other than colour, and counts them under the answer."""
    revise = {"edit_threshold": 0.2, "remask_budget": 4}
    open_page(driver, server)
    set_field(driver, "set-max-tokens", "40")
    set_field(driver, "set-extra", json.dumps(revise))
    driver.execute_script(WATCH_RENDERS)
    send(driver, "Write a function that adds two numbers.")
    msg = wait(driver, lambda d: d.find_element(By.CSS_SELECTOR, ".msg.assistant[data-done]"), what="the answer")

    want = stream_frames(server, "/v1/chat/completions", {
        "model": "unmask-tiny", "max_tokens": 40, "temperature": 0, **revise,
        "messages": [{"role": "user", "content": "Write a function that adds two numbers."}]})
    edits = [f for f in want if marked(f)["edit"]]
    remasks = [f for f in want if marked(f)["remask"]]
    assert edits and remasks, "the server's frames show no edit or no remask: the test would check nothing"
    assert all(f["text"][a:b] for f in want for a, b in f["edited"] + f["committed"])
    rendered = driver.execute_script("return window.__rendered")
    assert [drawn(r) for r in rendered] == [marked(f) for f in want]     # frame by frame, exactly

    # told apart by more than colour: a frame with an edit (and a remask, where one has both) drawn again to look at
    both = [f for f in edits if marked(f)["remask"]]
    driver.execute_script("renderFrame(document.querySelector('.msg.assistant .frame'), arguments[0]);"
                          "document.querySelector('.msg.assistant details.denoise').open = true;",
                          (both or edits)[-1])
    style = lambda sel, prop: driver.execute_script(  # noqa: E731
        "return getComputedStyle(document.querySelector(arguments[0]))[arguments[1]]", sel, prop)
    edit, new, mask = ".msg.assistant .frame .tok-edit", ".msg.assistant .frame .tok-new", ".msg.assistant .frame .tok-mask"
    assert style(edit, "fontStyle") == "italic" and "wavy" in style(edit, "textDecorationStyle")
    if driver.find_elements(By.CSS_SELECTOR, new):
        assert style(new, "fontStyle") == "normal" and style(new, "fontWeight") == "700"
    if driver.find_elements(By.CSS_SELECTOR, mask):
        assert style(mask, "outlineStyle") == "dashed"
    remask = driver.find_elements(By.CSS_SELECTOR, ".msg.assistant .frame .tok-remask")
    if remask:
        assert style(".msg.assistant .frame .tok-remask", "outlineStyle") == "double"
        assert remask[0].get_attribute("title") == "put back to mask this step"
    assert driver.find_element(By.CSS_SELECTOR, edit).get_attribute("title") == "edited this step"
    screenshot(driver, "playground-edits", tmp_path)

    last = want[-1]
    stats = msg.find_element(By.CSS_SELECTOR, ".stats").get_attribute("textContent")
    assert f"{last['edits']} edits" in stats and f"{last['remasks']} remasks" in stats, stats


def test_settings_are_kept_across_reloads_and_sent(server, driver):
    open_page(driver, server)
    kept = {"set-effort": "low", "set-policy": "threshold", "set-threshold": "0.85", "set-block": "8",
            "set-temperature": "0.5", "set-max-tokens": "6", "set-extra": '{"seed": 3, "ignore_eos": true}',
            "system": "Be brief."}
    for element_id, value in kept.items():
        set_field(driver, element_id, value)
    driver.find_element(By.ID, "set-diffusing").click()            # off: a checkbox is kept too
    driver.refresh()
    wait(driver, lambda d: d.find_element(By.ID, "status").text == "ready", what="the models after the reload")
    for element_id, value in kept.items():
        assert driver.find_element(By.ID, element_id).get_attribute("value") == value, element_id
    assert not driver.find_element(By.ID, "set-diffusing").is_selected()
    assert driver.find_element(By.ID, "set-model").get_attribute("value") == "unmask-tiny"
    assert driver.execute_script("return localStorage.getItem('unmask.apiKey')") == KEY    # the key apart

    # the kept settings are what the next request carries, and what the server did
    driver.execute_script(WATCH_REQUESTS)
    send(driver, "Hello")
    msg = wait(driver, lambda d: d.find_element(By.CSS_SELECTOR, ".msg.assistant[data-done]"), what="the answer")
    body = driver.execute_script("return window.__bodies")[-1]
    assert {k: body.get(k) for k in ("model", "reasoning_effort", "policy", "threshold", "block_size", "temperature",
                                     "max_tokens", "seed", "ignore_eos")} == {
        "model": "unmask-tiny", "reasoning_effort": "low", "policy": "threshold", "threshold": 0.85, "block_size": 8,
        "temperature": 0.5, "max_tokens": 6, "seed": 3, "ignore_eos": True}
    assert body["messages"][0] == {"role": "system", "content": "Be brief."} and "diffusing" not in body
    assert "6 tokens" in msg.find_element(By.CSS_SELECTOR, ".stats").get_attribute("textContent")

    # "Default settings" puts the page's defaults back, and they stay after a reload; the key stays
    driver.find_element(By.ID, "default-settings").click()
    driver.refresh()
    wait(driver, lambda d: d.find_element(By.ID, "status").text == "ready", what="the models after the reset")
    assert driver.find_element(By.ID, "set-max-tokens").get_attribute("value") == "256"
    assert driver.find_element(By.ID, "set-extra").get_attribute("value") == ""
    assert driver.find_element(By.ID, "set-diffusing").is_selected()
    assert driver.execute_script("return localStorage.getItem('unmask.apiKey')") == KEY


def test_keyboard_use_and_labels(server, driver):
    open_page(driver, server)
    unlabelled = driver.execute_script("""
        return [...document.querySelectorAll('input, select, textarea')].filter((el) => !el.labels.length
            && !el.getAttribute('aria-label')).map((el) => el.id);""")
    assert unlabelled == []
    tab = driver.find_element(By.ID, "tab-chat")
    tab.send_keys(Keys.ARROW_RIGHT)                                  # arrow keys move between the mode tabs
    assert driver.switch_to.active_element.get_attribute("id") == "tab-fim"
    assert not driver.find_element(By.ID, "mode-fim").get_attribute("hidden")
    driver.switch_to.active_element.send_keys(Keys.ARROW_LEFT)
    assert driver.find_element(By.ID, "tab-chat").get_attribute("aria-selected") == "true"
    set_field(driver, "set-max-tokens", "4")
    box = driver.find_element(By.ID, "input")
    box.send_keys("Hi", Keys.SHIFT, Keys.ENTER, Keys.SHIFT, "there")    # Shift+Enter: a new line, not sent
    assert box.get_attribute("value") == "Hi\nthere" and not driver.find_elements(By.CSS_SELECTOR, ".msg.user")
    box.send_keys(Keys.ENTER)                                         # Enter sends
    wait(driver, lambda d: d.find_element(By.CSS_SELECTOR, ".msg.assistant[data-done]"), what="the answer")
    assert driver.find_element(By.CSS_SELECTOR, ".msg.user").text == "Hi\nthere"


CONTRAST = """
const rgb = (c) => (c.match(/[\\d.]+/g) || []).map(Number);
const lum = ([r, g, b]) => { const f = (v) => { v /= 255; return v <= 0.03928 ? v / 12.92 : ((v + 0.055) / 1.055) ** 2.4; };
                             return 0.2126 * f(r) + 0.7152 * f(g) + 0.0722 * f(b); };
const background = (el) => { for (; el; el = el.parentElement) { const c = rgb(getComputedStyle(el).backgroundColor);
                                                                  if (c.length < 4 || c[3] > 0) return c; }
                             return [255, 255, 255]; };
return [...document.querySelectorAll(arguments[0])].filter((el) => el.offsetParent !== null).map((el) => {
  const a = lum(rgb(getComputedStyle(el).color)), b = lum(background(el));
  return [el.id || el.className || el.tagName, (Math.max(a, b) + 0.05) / (Math.min(a, b) + 0.05)];
});
"""


def test_text_contrast_is_at_least_4_5_to_1(server, driver):
    """WCAG AA for normal text, computed in the page from the styles in effect: labels, hints, buttons, the mode
    tabs, the status line and every token state of the denoising legend (the same classes as the view)."""
    open_page(driver, server)
    pairs = driver.execute_script(CONTRAST, "label, .hint, button, [role=tab], #status, .legend li, .legend .tok")
    assert len(pairs) > 20 and {"tok tok-mask", "tok tok-new", "tok tok-edit", "tok tok-remask"} <= {n for n, _ in pairs}
    low = [(name, round(ratio, 2)) for name, ratio in pairs if ratio < 4.5]
    assert low == [], low
