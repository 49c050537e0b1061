"""The StepExplorer in a real browser: JupyterLab + Debian's Chromium, driven by Playwright.

    JupyterLab on 127.0.0.1 (free port, random token, temp root and config dirs)
      <- Chromium (own process group, fresh profile, DevTools on a free port)
           <- Playwright connect_over_cdp
    open step_explorer.ipynb -> run all cells -> widget image appears
    -> press ArrowRight on the slider -> the kernel redraws -> the image bytes change

Every process the test starts is stopped by process group, and every process
they started (the kernel has its own session) by pid. The whole test is bounded
by TIME_LIMIT_S. Skipped only if /usr/bin/chromium is absent and CI is unset;
in CI a missing browser is a failure.

The widget's screenshot goes to tests/artifacts/ (ignored by git); with
MICROVLLM_UPDATE_README_IMAGE=1 it replaces the README's notebooks/images/step_explorer.png.
"""

import base64
import io
import os
import secrets
import shutil
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest

from microvllm.testing import free_port
from microvllm.viz.demo import demo_trace

CHROMIUM = Path("/usr/bin/chromium")
TIME_LIMIT_S = 120
REPO = Path(__file__).resolve().parents[2]
NOTEBOOK = Path(__file__).with_name("step_explorer.ipynb")
ARTIFACTS = REPO / "tests" / "artifacts"
README_IMAGE = REPO / "notebooks" / "images" / "step_explorer.png"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]

if not CHROMIUM.exists():
    if os.environ.get("CI"):
        pytest.fail(f"{CHROMIUM} is missing but CI is set: install it with "
                    "`apt-get update && apt-get install -y chromium`", pytrace=False)
    pytest.skip(f"{CHROMIUM} is not installed (apt-get install -y chromium); CI is not set",
                allow_module_level=True)
if os.environ.get("CI"):
    from playwright.sync_api import sync_playwright
else:
    sync_playwright = pytest.importorskip("playwright.sync_api").sync_playwright


def descendants(pid: int) -> set[tuple[int, str]]:
    """(pid, start time) of every process below `pid` (Linux /proc)."""
    children: dict[int, list[tuple[int, str]]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            children.setdefault(int(fields[1]), []).append((int(entry.name), fields[19]))
    found, todo = set(), [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.add(child)
            todo.append(child[0])
    return found


def alive(pid: int, start_time: str) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return False
    return stat[19] == start_time and stat[0] != "Z"


def stop_group(proc: subprocess.Popen, grace_s: float = 8.0) -> None:
    """SIGTERM the process group started with `proc`, then SIGKILL what is left."""
    for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 5.0)):
        if proc.poll() is not None:
            break
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            break
        try:
            proc.wait(timeout=wait_s)
        except subprocess.TimeoutExpired:
            continue
    if proc.poll() is None:
        proc.kill()
        proc.wait(timeout=5)


def wait_until(what: str, check, deadline: float, interval: float = 0.3):
    while time.monotonic() < deadline:
        result = check()
        if result:
            return result
        time.sleep(interval)
    raise TimeoutError(f"timed out waiting for {what}")


def start_jupyterlab(root: Path, home: Path, port: int, token: str, log) -> subprocess.Popen:
    settings = home / "config" / "lab" / "user-settings" / "@jupyterlab" / "apputils-extension"
    settings.mkdir(parents=True, exist_ok=True)                   # no "news?" pop-up over the page
    (settings / "notification.jupyterlab-settings").write_text('{"fetchNews": "false", "checkForUpdates": false}')
    env = dict(os.environ, JUPYTER_CONFIG_DIR=str(home / "config"), JUPYTER_DATA_DIR=str(home / "data"),
               JUPYTER_RUNTIME_DIR=str(home / "runtime"), IPYTHONDIR=str(home / "ipython"),
               PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
               PATH=os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")]))
    env.pop("MPLBACKEND", None)
    command = [sys.executable, "-m", "jupyterlab", "--no-browser", "--ip=127.0.0.1", f"--port={port}",
               "--ServerApp.port_retries=0", f"--ServerApp.root_dir={root}", f"--IdentityProvider.token={token}",
               "--ServerApp.allow_root=True", "--ServerApp.terminals_enabled=False",
               "--LabApp.expose_app_in_browser=True", "--LabApp.news_url=None",
               "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate",
               "--MappingKernelManager.default_kernel_name=python3"]
    return subprocess.Popen(command, cwd=root, env=env, stdout=log, stderr=subprocess.STDOUT,
                            stdin=subprocess.DEVNULL, start_new_session=True)


def start_chromium(profile: Path, log) -> subprocess.Popen:
    command = [str(CHROMIUM), *CHROMIUM_ARGS, f"--user-data-dir={profile}", "--remote-debugging-address=127.0.0.1",
               "--remote-debugging-port=0", "--window-size=1400,1400", "about:blank"]
    return subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                            start_new_session=True)


IMAGE_BYTES_JS = """async () => {
    const img = document.querySelector('img.widget-image');
    if (!img || !img.complete || img.naturalWidth === 0) return null;
    const bytes = new Uint8Array(await (await fetch(img.src)).arrayBuffer());
    let text = ''; for (const b of bytes) text += String.fromCharCode(b);
    return btoa(text);
}"""
KERNEL_IDLE_JS = """() => {
    const panel = window.jupyterapp && window.jupyterapp.shell.currentWidget;
    const kernel = panel && panel.sessionContext && panel.sessionContext.session
                   && panel.sessionContext.session.kernel;
    return !!kernel && kernel.status === 'idle' && !!panel.content && panel.content.widgets.length >= 4;
}"""


def widget_image(page) -> bytes | None:
    data = page.evaluate(IMAGE_BYTES_JS)
    return base64.b64decode(data) if data else None


def caption(page) -> str:
    return page.evaluate("() => (document.querySelector('.widget-html-content') || {}).innerText || ''")


@pytest.mark.slow   # 16-18 s on 2 cores: Jupyter's server, a kernel and Chromium
def test_step_explorer_slider_redraws_in_chromium(tmp_path):
    start = time.monotonic()
    deadline = start + TIME_LIMIT_S - 15              # leave time to stop everything
    root, home, profile = tmp_path / "root", tmp_path / "home", tmp_path / "chromium-profile"
    for folder in (root, home, profile, ARTIFACTS):
        folder.mkdir(parents=True, exist_ok=True)
    shutil.copy(NOTEBOOK, root / "step_explorer.ipynb")
    trace = demo_trace("preemption")
    trace.save(root / "trace.json")
    preempted_at = trace.preemption_steps()[0]                # the first preemption, then its return
    victim = trace[preempted_at].preempted[0]
    resumed_at = next(i for i in range(preempted_at + 1, len(trace))
                      if any(r.request_id == victim and r.prefix_hit_tokens for r in trace[i].scheduled))
    port, token = free_port(), secrets.token_hex(16)
    base = f"http://127.0.0.1:{port}"
    processes: list[subprocess.Popen] = []
    lab_log = open(ARTIFACTS / "jupyterlab.log", "wb")
    chromium_log = open(ARTIFACTS / "chromium.log", "wb")
    watchdog = threading.Timer(TIME_LIMIT_S - 10, lambda: [stop_group(p, 1.0) for p in processes])
    watchdog.start()
    spawned: set[tuple[int, str]] = set()
    try:
        lab = start_jupyterlab(root, home, port, token, lab_log)
        processes.append(lab)

        def lab_ready():
            assert lab.poll() is None, f"JupyterLab exited: see {ARTIFACTS / 'jupyterlab.log'}"
            try:
                with urllib.request.urlopen(f"{base}/api/status?token={token}", timeout=2) as reply:
                    return reply.status == 200
            except OSError:
                return False

        wait_until("JupyterLab to answer", lab_ready, deadline)
        browser_proc = start_chromium(profile, chromium_log)
        processes.append(browser_proc)
        devtools = wait_until("Chromium's DevTools port", lambda: (profile / "DevToolsActivePort").exists()
                              and (profile / "DevToolsActivePort").read_text().split("\n")[0], deadline)
        with sync_playwright() as playwright:
            browser = playwright.chromium.connect_over_cdp(f"http://127.0.0.1:{devtools}",
                                                           timeout=(deadline - time.monotonic()) * 1000)
            page = browser.contexts[0].new_page()
            page.set_viewport_size({"width": 1400, "height": 1400})
            page.set_default_timeout(max(1.0, deadline - time.monotonic()) * 1000)
            page.goto(f"{base}/lab/tree/step_explorer.ipynb?token={token}", wait_until="domcontentloaded")
            page.wait_for_function(KERNEL_IDLE_JS, polling=500)
            page.evaluate("() => window.jupyterapp.commands.execute('notebook:run-all-cells')")
            before = wait_until("the widget's first image", lambda: widget_image(page), deadline, 0.5)
            assert before.startswith(b"\x89PNG")
            wait_until("the caption of step 0", lambda: caption(page).startswith("Step 0 "), deadline)
            page.wait_for_selector(".jp-OutputArea-output img:not(.widget-image)")   # show_static's figure
            spawned |= descendants(lab.pid) | descendants(browser_proc.pid)

            handle = page.locator(".widget-slider .noUi-handle").first
            handle.focus()
            for _ in range(preempted_at):
                handle.press("ArrowRight")
            wait_until(f"the caption of step {preempted_at}",
                       lambda: caption(page).startswith(f"Step {preempted_at} "), deadline)
            after = wait_until("a new image", lambda: (img := widget_image(page)) != before and img, deadline)
            assert after.startswith(b"\x89PNG") and after != before
            assert f"Preempted (blocks freed, back to waiting for recompute): {victim}." in caption(page)
            for _ in range(resumed_at - preempted_at):   # on to its return: cache hits and shared blocks
                handle.press("ArrowRight")
            wait_until(f"the caption of step {resumed_at}",
                       lambda: caption(page).startswith(f"Step {resumed_at} "), deadline)
            assert f"{victim} (resumed, " in caption(page)
            wait_until(f"the image of step {resumed_at}",
                       lambda: widget_image(page) not in (before, after), deadline)

            page.screenshot(path=str(ARTIFACTS / "step_explorer_browser.png"))
            widget_png = page.locator(".widget-vbox").first.screenshot()
            # The committed README image is refreshed only on request, so that a test run
            # leaves the tree as it found it (the artifacts folder is ignored by git).
            target = README_IMAGE if os.environ.get("MICROVLLM_UPDATE_README_IMAGE") else \
                ARTIFACTS / "step_explorer_widget.png"
            save_small_png(widget_png, target)

            # The projector preset on a 1080p screen: drawn at least at its own size (the output area
            # may stretch it to its width, never shrink it), so no text under 14 px.
            page.set_viewport_size({"width": 1920, "height": 1080})
            page.evaluate("() => window.jupyterapp.commands.execute('application:toggle-left-area')"
                          " .catch(() => null)")
            projector = page.locator("img.widget-image").nth(1)
            projector.scroll_into_view_if_needed()
            wait_until("the projector widget's image", lambda: projector.evaluate(
                "img => img.complete && img.naturalWidth > 0"), deadline)
            page.wait_for_timeout(300)                      # let the left area finish closing
            natural, shown = projector.evaluate("img => [img.naturalWidth, img.clientWidth]")
            projector.screenshot(path=str(ARTIFACTS / "step_explorer_projector_browser.png"))
            assert natural == 1600 and shown >= natural, f"projector image {natural} px wide shown at {shown} px"
            print(f"\nprojector preset on a 1920 x 1080 page: {natural} px image shown {shown} px wide")
            browser.close()
        elapsed = time.monotonic() - start
        print(f"\nbrowser test: explorer rendered and redrew in Chromium in {elapsed:.1f} s")
    finally:
        watchdog.cancel()
        for proc in processes:
            spawned |= descendants(proc.pid)
        shutdown_lab(base, token, processes[0] if processes else None)
        for proc in reversed(processes):
            stop_group(proc)
        for pid, start_time in spawned:               # e.g. the kernel, which runs in its own session
            if alive(pid, start_time):
                os.kill(pid, signal.SIGKILL)
        lab_log.close()
        chromium_log.close()
    # SIGKILL is asynchronous: a killed process can still be exiting a moment later.
    deadline = time.monotonic() + 5.0
    while any(alive(pid, t) for pid, t in spawned) and time.monotonic() < deadline:
        time.sleep(0.05)
    survivors = [pid for pid, start_time in spawned if alive(pid, start_time)]
    assert not survivors, f"processes left running 5 s after SIGKILL: {survivors}"
    assert time.monotonic() - start < TIME_LIMIT_S


def shutdown_lab(base: str, token: str, lab: subprocess.Popen | None) -> None:
    """Ask JupyterLab to stop its kernels and exit (then stop_group makes sure)."""
    if lab is None or lab.poll() is not None:
        return
    request = urllib.request.Request(f"{base}/api/shutdown", method="POST",
                                     headers={"Authorization": f"token {token}"})
    try:
        urllib.request.urlopen(request, timeout=5).close()
        lab.wait(timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        pass


def save_small_png(png: bytes, path: Path, max_width: int = 900) -> None:
    """A README-sized copy: at most `max_width` pixels wide, palette-compressed."""
    from PIL import Image

    image = Image.open(io.BytesIO(png)).convert("RGB")
    if image.width > max_width:
        image = image.resize((max_width, round(image.height * max_width / image.width)), Image.LANCZOS)
    path.parent.mkdir(parents=True, exist_ok=True)
    image.quantize(colors=256, method=Image.Quantize.FASTOCTREE).save(path, optimize=True)
