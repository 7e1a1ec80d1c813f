"""The web console in a real browser (Debian's chromium driven by Playwright; no browser is downloaded):
sign in -> plan -> submit a short CPU job -> watch it finish -> its bill -> the tenant's bill, at laptop and
phone widths, with a screenshot of each page under the test's output; and one tenant's browser session
cannot open another tenant's job page."""

from __future__ import annotations

import os
import shutil
import signal
from pathlib import Path

import pytest
from service_fixtures import TINY_JOB, free_port, make_settings, start_server

from starverse.service.db import Database, migrate
from starverse.service.tenants import create_tenant, create_token

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]
CHROMIUM = "/usr/bin/chromium"
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
         "--disable-component-update", "--disable-sync", "--no-first-run", "--disable-dev-shm-usage"]


@pytest.fixture
def browser():  # type: ignore[no-untyped-def]
    """Debian's chromium under Playwright."""
    if not Path(CHROMIUM).is_file():
        if os.environ.get("CI"):
            pytest.fail(f"{CHROMIUM} is missing on CI; .ci/run installs it (apt-get install -y chromium)")
        pytest.skip(f"{CHROMIUM} not installed (apt-get install chromium); the browser test runs on CI")
    sync_api = pytest.importorskip("playwright.sync_api")
    with sync_api.sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=FLAGS, headless=True)
        try:
            yield b
        finally:
            b.close()


def _sign_in(page, base: str, token: str) -> None:  # type: ignore[no-untyped-def]
    page.goto(base + "/")
    page.fill("#token", token)
    page.click("#signin-form button[type=submit]")
    page.wait_for_selector("#plan-form")


def _no_horizontal_scroll(page) -> bool:  # type: ignore[no-untyped-def]
    return bool(page.evaluate("document.documentElement.scrollWidth <= window.innerWidth + 1"))


# the browser test runs on SQLite (the API tests cover PostgreSQL)
@pytest.mark.parametrize("db_url", [""], ids=["sqlite"])
def test_console_sign_in_plan_submit_watch_bill(browser, tmp_path: Path, db_url: str) -> None:  # type: ignore[no-untyped-def]
    shots = tmp_path / "screenshots"
    shots.mkdir()
    settings = make_settings(tmp_path / "root", db_url)
    migrate(settings.url)
    db = Database(settings.url)
    create_tenant(db, settings, "alice")
    create_tenant(db, settings, "bob")
    alice, bob = create_token(db, "alice"), create_token(db, "bob")
    port = free_port()
    server = start_server(settings.root, db_url, port, slots=1)
    base = f"http://127.0.0.1:{port}"
    try:
        ctx = browser.new_context(viewport={"width": 1366, "height": 900})
        page = ctx.new_page()
        page.goto(base + "/")
        page.wait_for_selector("#signin-form")
        page.fill("#token", "sv_wrong")
        page.click("#signin-form button[type=submit]")
        page.wait_for_function("document.getElementById('signin-error').textContent.length > 0")
        page.screenshot(path=str(shots / "01-sign-in-refused.png"), full_page=True)
        page.fill("#token", alice)
        page.click("#signin-form button[type=submit]")
        page.wait_for_selector("#plan-form")
        assert "tenant alice" in page.inner_text("#who")

        page.click("#plan-submit")
        page.wait_for_selector("#plans-table tbody tr", timeout=120_000)
        assert page.locator("#plans-table tbody tr").count() >= 2
        assert "Chosen: plan 1" in page.inner_text("#plan-chosen")
        assert page.locator("#pareto svg path").count() >= 2  # frontier and the chosen plan's star
        assert page.locator("#plan-why li").count() == page.locator("#plans-table tbody tr").count()
        page.screenshot(path=str(shots / "02-plan.png"), full_page=True)

        # an infeasible job: the reasons say what would make it feasible
        page.fill("#plan-job", "model: llama-2-7b\ntrain: {seq_len: 4096, global_batch: 128, tokens: 2.0e9}\n"
                               "constraints: {max_budget_per_hour: 0.1}\n")
        page.fill("#plan-pool", "currency: USD\noffers:\n  - {accelerator: rtx-4090, count: 2, price_per_hour: 0.69}\n")
        page.click("#plan-submit")
        page.wait_for_selector("#infeasible", timeout=120_000)
        assert "No plan fits" in page.inner_text("#infeasible")
        assert "What would make it feasible" in page.inner_text("#infeasible")
        page.screenshot(path=str(shots / "03-plan-infeasible.png"), full_page=True)

        page.click("a[data-nav=jobs]")
        page.wait_for_selector("#submit-form")
        job = {**TINY_JOB, "train": {**TINY_JOB["train"], "steps": 6}}
        import yaml

        page.fill("#job-name", "browser-job")
        page.fill("#job-yaml", yaml.safe_dump(job, sort_keys=False))
        page.click("#job-submit")
        page.wait_for_selector("#job-title")
        job_url = page.url
        job_id = job_url.rsplit("/", 1)[-1]
        page.wait_for_function("document.getElementById('job-state').textContent === 'running'", timeout=300_000)
        page.screenshot(path=str(shots / "04-job-running.png"), full_page=True)
        page.wait_for_function("['succeeded','failed','stopped'].includes(document.getElementById('job-state')"
                               ".textContent)", timeout=400_000)
        assert page.inner_text("#job-state") == "succeeded", page.inner_text("#log")
        # one dot per sample (a 6-step job on a fast machine may have a single sample: a path of one point is
        # not visible, its dot is)
        page.wait_for_selector("#chart-loss svg circle")
        assert page.locator("#chart-tps svg path").count() >= 1
        assert page.locator("#ckpt-table tbody tr").count() >= 1
        net = page.inner_text("#bill-net")
        assert net.endswith("USD") and float(net.split()[0]) >= 0
        page.screenshot(path=str(shots / "05-job-finished.png"), full_page=True)

        page.click("a[data-nav=bill]")
        page.wait_for_selector("#bill-by-job")
        # a lease under one billed second (a fast machine runs the 6 steps in it) has no charge, hence no line
        by_job = page.inner_text("#bill-by-job")
        assert ("browser-job" in by_job) if float(net.split()[0]) > 0 else ("Nothing billed yet." in by_job)
        assert "signup" in page.inner_text("main")
        page.screenshot(path=str(shots / "06-bill.png"), full_page=True)

        page.set_viewport_size({"width": 390, "height": 844})
        for name, url in (("07-phone-job.png", job_url), ("08-phone-bill.png", base + "/#/bill"),
                          ("09-phone-plan.png", base + "/#/plan")):
            page.goto(url)
            page.wait_for_selector("main section")
            page.wait_for_timeout(300)
            assert _no_horizontal_scroll(page), name
            page.screenshot(path=str(shots / name), full_page=True)
        ctx.close()

        # bob, signed in, opens alice's job page: not found, and nothing of hers is shown
        other = browser.new_context(viewport={"width": 1366, "height": 900})
        bpage = other.new_page()
        _sign_in(bpage, base, bob)
        bpage.goto(f"{base}/#/job/{job_id}")
        # a change of the hash only: the plan page stays until the router has the API's answer (a busy machine)
        bpage.wait_for_selector("#plan-form", state="detached")
        bpage.wait_for_selector("main h1")
        assert bpage.inner_text("main h1") == "Not found"
        assert "browser-job" not in bpage.inner_text("body")
        bpage.screenshot(path=str(shots / "10-other-tenant-job-not-found.png"), full_page=True)
        bpage.goto(f"{base}/#/jobs")
        bpage.wait_for_selector("#jobs-table")
        assert "No jobs yet" in bpage.inner_text("#jobs-table")
        bpage.screenshot(path=str(shots / "11-other-tenant-jobs.png"), full_page=True)
        other.close()
    finally:
        server.send_signal(signal.SIGTERM)
        server.wait(timeout=120)
        db.dispose()
    keep = os.environ.get("STARVERSE_SCREENSHOTS")
    if keep:
        shutil.copytree(shots, keep, dirs_exist_ok=True)
    assert len(list(shots.glob("*.png"))) == 11
