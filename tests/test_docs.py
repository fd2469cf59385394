"""The documentation site, built from the notebooks and checked in headless Chromium as a reader would see it."""
import functools
import http.server
import os
import re
import shutil
import threading
from pathlib import Path
from urllib.parse import urljoin, urlparse

import pytest

ROOT = Path(__file__).resolve().parents[1]
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")
CHROMEDRIVER = shutil.which("chromedriver")

EXECUTED = ("01_surprisal", "02_weights", "03_reconstruction", "04_objective", "13_results")  # the pages whose outputs these tests read

pytestmark = pytest.mark.skipif(not (CHROMIUM and CHROMEDRIVER),
                                reason="no headless browser: install Debian's chromium and chromium-driver to run the docs test")


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    from basedirected.docsite import build_docs
    out = tmp_path_factory.mktemp("site")
    # nbdev_test has run every notebook, so the site executes only the pages whose outputs these tests read (the derivation's
    # figures and the results page's); the others show their stored outputs, and every page's prose, math and links are checked
    pages = build_docs(ROOT / "nbs", out, mathjax="local", execute=EXECUTED, jobs=2, skip=("slow",))
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(out))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield out, pages, f"http://127.0.0.1:{server.server_address[1]}/"
    server.shutdown()


@pytest.fixture(scope="module")
def browser():
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service
    opts = webdriver.ChromeOptions()
    opts.binary_location = CHROMIUM
    for flag in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--disable-dev-shm-usage", "--window-size=1400,1000"):
        opts.add_argument(flag)
    opts.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=opts)
    driver.set_page_load_timeout(60)
    yield driver
    driver.quit()


def _load(driver, url):
    from selenium.webdriver.support.ui import WebDriverWait
    driver.get(url)
    # MathJax 3: startup.promise resolves once the page is typeset (at once on a page without math)
    # polled every 20 ms, not selenium's default 0.5 s: a page is typeset in well under a second, and the wait is idle time on every page
    WebDriverWait(driver, 60, poll_frequency=0.02).until(lambda d: d.execute_script(
        "if (document.readyState !== 'complete') return false; if (!window.MathJax) return true;"
        "if (!window.__bd_mj && MathJax.startup && MathJax.startup.promise) { window.__bd_mj = 'waiting';"
        " MathJax.startup.promise.then(function () { window.__bd_mj = 'done'; }, function (e) { window.__bd_mj = 'failed: ' + e; }); }"
        "return !!window.__bd_mj && window.__bd_mj !== 'waiting';"))
    state = driver.execute_script("return window.MathJax ? window.__bd_mj : 'no math';")
    assert state in ("done", "no math"), f"{url}: MathJax {state}"


def test_every_page_renders_cleanly(site, browser):
    out, pages, base = site
    assert [p.name for p in pages][:3] == ["index.html", "00_conventions.html", "01_surprisal.html"]
    problems = []
    for page in pages:
        url = urljoin(base, page.name)
        _load(browser, url)
        errors = [e for e in browser.get_log("browser") if e["level"] == "SEVERE"]
        if errors: problems.append(f"{page.name}: console errors {errors}")
        # prose only (rendered Markdown cells and outputs): code may legitimately contain dollar signs
        text = browser.execute_script(
            "return Array.from(document.querySelectorAll('.jp-RenderedMarkdown')).map(e => e.innerText).join('\\n');")
        raw = re.findall(r"\$\$[^$]+\$\$|(?<![\w$])\$[^$\s][^$\n]*?\$(?![\w$])", text)
        if raw: problems.append(f"{page.name}: untypeset math {raw[:3]}")
        tex_errors = browser.execute_script("return Array.from(document.querySelectorAll('mjx-merror')).map(e => e.getAttribute('data-mjx-error') || e.textContent);")
        if tex_errors: problems.append(f"{page.name}: MathJax errors {tex_errors[:3]}")
        bad_images = browser.execute_script(
            "return Array.from(document.images).filter(i => !(i.complete && i.naturalWidth > 0 && i.naturalHeight > 0)).map(i => i.src.slice(0, 80));")
        if bad_images: problems.append(f"{page.name}: images not loaded {bad_images}")
        for href in browser.execute_script("return Array.from(document.querySelectorAll('a[href]')).map(a => a.getAttribute('href'));"):
            target = urlparse(href)
            if target.scheme or href.startswith("#") or href.startswith("mailto:"): continue
            path = (out / page.parent.relative_to(out) / target.path) if target.path else page
            if not path.exists(): problems.append(f"{page.name}: broken link {href}")
    assert not problems, "\n".join(problems)


def test_math_is_typeset_on_the_derivation_pages(site, browser):
    out, _, base = site
    for name in ("02_weights.html", "03_reconstruction.html"):
        _load(browser, urljoin(base, name))
        n = browser.execute_script("return document.querySelectorAll('.mjx-chtml, .MathJax, mjx-container').length;")
        assert n > 20, f"{name}: only {n} typeset formulas"


def test_api_reference_lists_every_public_function(site, browser):
    import basedirected.reconstruction as reconstruction
    import basedirected.weights as weights
    out, _, base = site
    for module, page in ((weights, "02_weights.html"), (reconstruction, "03_reconstruction.html")):
        _load(browser, urljoin(base, page))
        headings = set(browser.execute_script(
            "return Array.from(document.querySelectorAll('h2, h3, h4')).map(h => h.innerText.trim());"))
        public = [n for n in module.__all__ if callable(getattr(module, n))]
        missing = [n for n in public if not any(h.startswith(n) for h in headings)]
        assert not missing, f"{page}: no API entry for {missing}"


def test_results_page_shows_the_experiment_figures(site, browser):
    out, _, base = site
    _load(browser, urljoin(base, "13_results.html"))
    sizes = browser.execute_script("return Array.from(document.images).map(i => [i.naturalWidth, i.naturalHeight]);")
    assert len(sizes) >= 3 and all(w > 100 and h > 100 for w, h in sizes)


def test_derivation_pages_show_their_figures(site, browser):
    out, _, base = site
    for name in ("01_surprisal.html", "02_weights.html", "03_reconstruction.html", "04_objective.html"):
        _load(browser, urljoin(base, name))
        sizes = browser.execute_script("return Array.from(document.querySelectorAll('.jp-OutputArea img')).map(i => [i.naturalWidth, i.naturalHeight]);")
        assert any(w > 300 and h > 100 for w, h in sizes), f"{name}: no rendered figure ({sizes})"


def test_search_leads_from_a_name_to_its_definition(site, browser):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys
    from selenium.webdriver.support.ui import WebDriverWait
    out, _, base = site
    assert (out / "search-index.js").stat().st_size > 10_000 and (out / "search.js").exists()
    _load(browser, urljoin(base, "13_results.html"))
    browser.find_element(By.ID, "bd-search").send_keys("concentration_factor")
    hits = WebDriverWait(browser, 10, poll_frequency=0.02).until(lambda d: d.find_elements(By.CSS_SELECTOR, "#bd-results a"))
    assert hits[0].text.startswith("Token weights › concentration_factor")
    hits[0].click()
    WebDriverWait(browser, 30, poll_frequency=0.02).until(lambda d: urlparse(d.current_url).path.endswith("/02_weights.html"))
    assert urlparse(browser.current_url).fragment == "concentration_factor" and browser.title == "Token weights – basedirected"
    assert browser.find_element(By.ID, "concentration_factor").text.startswith("concentration_factor")
    # Enter follows the first result; a query that matches nothing says so
    box = browser.find_element(By.ID, "bd-search")
    box.clear(); box.send_keys("reference_weights", Keys.ENTER)
    WebDriverWait(browser, 30, poll_frequency=0.02).until(lambda d: urlparse(d.current_url).fragment == "reference_weights")
    assert urlparse(browser.current_url).path.endswith("/02_weights.html")
    box.clear(); box.send_keys("qwertyuiop")
    assert browser.find_element(By.ID, "bd-results").text == "No results"


def test_previous_and_next_links_follow_the_reading_order(site, browser):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait
    out, pages, base = site
    names = [p.name for p in pages]
    for i, page in enumerate(pages):
        text = page.read_text()
        prev, nxt = (re.search(rf'<a rel="{r}" href="([^"]+)"', text) for r in ("prev", "next"))
        assert (prev and prev.group(1)) == (names[i - 1] if i > 0 else None), page.name
        assert (nxt and nxt.group(1)) == (names[i + 1] if i + 1 < len(names) else None), page.name
    _load(browser, urljoin(base, "01_surprisal.html"))
    browser.find_element(By.CSS_SELECTOR, ".bd-pager a[rel=next]").click()
    WebDriverWait(browser, 30, poll_frequency=0.02).until(lambda d: urlparse(d.current_url).path.endswith("/02_weights.html"))
    assert browser.title == "Token weights – basedirected"
    browser.find_element(By.CSS_SELECTOR, ".bd-pager a[rel=prev]").click()
    WebDriverWait(browser, 30, poll_frequency=0.02).until(lambda d: urlparse(d.current_url).path.endswith("/01_surprisal.html"))


def test_screenshot_of_the_objective_page(site, browser, tmp_path):
    out, _, base = site
    _load(browser, urljoin(base, "03_reconstruction.html"))
    target = Path(os.environ.get("BASEDIRECTED_SCREENSHOT", tmp_path / "reconstruction.png"))
    target.parent.mkdir(parents=True, exist_ok=True)
    browser.save_screenshot(str(target))
    assert target.stat().st_size > 20_000


def test_the_sidebar_is_in_sections_and_the_readme_reaches_the_objectives_code_in_one_click(site, browser):
    "The method, tasks, the model and its measures, running and reporting, and studies as sections of the sidebar; the README's first links are the method's, one of them J_theta's code."
    from selenium.webdriver.common.by import By
    out, pages, base = site
    _load(browser, urljoin(base, "index.html"))
    headings = [e.text.strip().lower() for e in browser.find_elements(By.CSS_SELECTOR, "#bd-nav .bd-section")]
    assert headings == ["the method", "tasks", "model and measures", "running and reporting", "studies", "building and developing"], headings
    readme = (ROOT / "README.md").read_text()
    links = re.findall(r"\]\((nbs/[^)#]+)", readme)
    assert links.index("nbs/04_objective.ipynb") < min(i for i, l in enumerate(links) if l.startswith("nbs/13")), links  # the method before any result
    _load(browser, urljoin(base, "04_objective.html"))
    assert "def j_theta" in browser.find_element(By.TAG_NAME, "main").text  # one click from the README: J_theta's code, on the page it links
