"""The Prefect UI in a real browser: Debian's Chromium (installed by infra/local/test-tools.sh) driven by
Playwright, which downloads no browser of its own. Used by the service tests to start a run from a
deployment's "Custom run" form as a person does, and to look at what the page shows."""

from __future__ import annotations

import json
import re
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

CHROMIUM = Path("/usr/bin/chromium")
# Flags for a closed network: without the background-networking ones Chromium keeps trying to reach Google.
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]


@contextmanager
def browser_page(url: str, auth_string: str | None = None) -> Iterator[Any]:
    """Headless Chromium on one page at `url`; closed on the way out. `auth_string`: the server asks for one, and
    it is typed into the UI's login page as a person does (the UI keeps it for the browser's session)."""
    from playwright.sync_api import expect, sync_playwright

    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS, headless=True)
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 1100})
            page.set_default_timeout(30_000)
            if auth_string:  # the UI's own login page (its redirect there waits on an auth check that may lag)
                origin = "/".join(url.split("/")[:3])
                page.goto(f"{origin}/login")
                login = page.get_by_placeholder("admin:pass")
                login.fill(auth_string)
                login.press("Enter")
                expect(page).not_to_have_url(re.compile(r"/login"))
            page.goto(url)
            yield page
        finally:
            browser.close()


@contextmanager
def file_page(path: Path) -> Iterator[tuple[Any, list[str], list[str]]]:
    """Headless Chromium on a file of this machine: the page, the errors its console and scripts raised, and every
    URL it requested (the file's own first), watched from before it loads."""
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS, headless=True)
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 1100})
            errors: list[str] = []
            requested: list[str] = []
            page.on("console", lambda message: errors.append(message.text) if message.type == "error" else None)
            page.on("pageerror", lambda error: errors.append(str(error)))
            page.on("request", lambda request: requested.append(request.url))
            page.goto(path.as_uri())
            page.wait_for_load_state("networkidle")
            yield page, errors, requested
        finally:
            browser.close()


@dataclass
class FormRun:
    flow_run: dict  # the create_flow_run response: id, name, parameters
    offered_profiles: list[str]  # the choices the form's profile select offered
    screenshot: Path


def ui_script_type(ui_url: str) -> str:
    """The content type the UI served at ui_url answers its own page's module script with (JavaScript when whole)."""
    with urllib.request.urlopen(f"{ui_url}/", timeout=10) as response:
        script = re.search(r'<script type="module"[^>]* src="([^"]+)"', response.read().decode())
    assert script, "the UI's page names no module script"
    with urllib.request.urlopen(f"{ui_url}{script.group(1)}", timeout=10) as response:
        return response.headers.get_content_type()


def ui_api_url(ui_url: str) -> str:
    """Where the UI served at ui_url sends its API calls (its /ui-settings)."""
    with urllib.request.urlopen(f"{ui_url}/ui-settings", timeout=10) as response:
        return json.loads(response.read())["api_url"]


def start_run_from_form(
    ui_url: str,
    deployment_id: str,
    profile: str,
    data_source: str,
    overrides: list[str],
    screenshots: Path,
    auth_string: str | None = None,
) -> FormRun:
    """Open the deployment's run page, choose the profile, type the data source and overrides, press
    Submit; return the run the UI created (read from the UI's own create_flow_run response)."""
    from playwright.sync_api import expect

    with browser_page(f"{ui_url}/deployments/deployment/{deployment_id}/run", auth_string) as page:

        def parameter(name: str):
            return form_property(page, f"{name} (")  # labels read "profile (Optional)"

        expect(page.get_by_role("heading", name="Parameters")).to_be_visible()
        expect(page.get_by_text("Oops. Something went wrong")).to_have_count(0)
        offered = choose(page, parameter("profile"), profile)

        # `str | None` and `list[str] | None` are a type toggle; None is preselected.
        source = parameter("data_source")
        source.get_by_role("button", name="str", exact=True).click()
        source.locator("input, textarea").first.fill(data_source)
        listed = parameter("overrides")
        listed.get_by_role("button", name="list", exact=True).click()
        for index, value in enumerate(overrides):
            listed.get_by_role("button", name="Add item").click()
            box = listed.locator(".p-draggable-list__item textarea").nth(index)
            box.fill(value)
            expect(box).to_have_value(value)
        screenshot = settled_screenshot(page, screenshots / "run-form.png")

        response = submit(page, page, f"/deployments/{deployment_id}/create_flow_run")
        assert response.status == 201, (response.status, response.text())
        flow_run = response.json()
        # The UI goes back to the deployment and says the run is scheduled.
        expect(page.locator(".toast-flow-run-create__message", has_text=flow_run["name"]).first).to_be_visible()
        expect(page.get_by_text("Oops. Something went wrong")).to_have_count(0)
        return FormRun(flow_run, offered, screenshot)


@dataclass
class Decision:
    report: str  # the gate report as the Resume form showed it
    artifacts: list[str]  # the artifact keys the run page listed
    screenshot: Path


def decide_paused_run(
    ui_url: str,
    flow_run_id: str,
    decision: str,
    reason: str,
    decided_by: str,
    screenshots: Path,
    auth_string: str | None = None,
) -> Decision:
    """Open a release waiting for approval (Suspended: a run of a deployment, without a process; Paused: in its
    process), read its artifacts and the gate report on the Resume form, fill the form (decision, reason, name) and
    press Submit, as a release manager does. The UI offers the same Resume form for both."""
    from playwright.sync_api import expect

    with browser_page(f"{ui_url}/runs/flow-run/{flow_run_id}", auth_string) as page:
        expect(page.get_by_text(re.compile(r"^(Suspended|Paused)$")).first).to_be_visible()
        page.locator("li.p-tab#artifacts").click()  # tabs are <li>s without role="tab"
        expect(page.get_by_text("gate-report").first).to_be_visible()
        artifacts = [
            key for key in ("gate-report", "release-report", "release-summary") if page.get_by_text(key).count()
        ]
        page.get_by_role("button", name="Resume").first.click()
        dialog = page.get_by_role("dialog")
        expect(dialog).to_contain_text("Resume Flow Run")
        report = dialog.locator("article.markdown-renderer").first
        expect(report).to_contain_text("Gate: PROMOTE")
        report_text = report.inner_text()
        choose(page, form_property(dialog, "Decision"), decision)
        form_property(dialog, "Reason").locator("textarea, input").first.fill(reason)
        form_property(dialog, "Decided By").locator("textarea, input").first.fill(decided_by)
        screenshot = settled_screenshot(page, screenshots / "approval-form.png")
        response = submit(page, dialog, f"/flow_runs/{flow_run_id}/resume")
        assert response.ok, (response.status, response.text())
        assert response.json()["status"] == "ACCEPT", response.text()
        expect(page.get_by_text("Oops. Something went wrong")).to_have_count(0)
        return Decision(report_text, artifacts, screenshot)


def submit(page: Any, form: Any, api_path: str) -> Any:
    """Press the form's Submit button; the response of the API call it makes (a POST to a path ending api_path)."""
    with page.expect_response(lambda r: r.request.method == "POST" and r.url.endswith(api_path)) as answered:
        form.get_by_role("button", name="Submit", exact=True).click()
    return answered.value


def form_property(scope: Any, label: str) -> Any:
    """One field of a Prefect schema form (a run's parameters, a pause's input), by the start of its label."""
    page = getattr(scope, "page", scope)  # `has` takes a locator of the page, matched inside each candidate
    return scope.locator(".schema-form-property").filter(
        has=page.locator(".schema-form-property__label", has_text=label)
    )


def choose(page: Any, field: Any, option: str) -> list[str]:
    """Pick `option` in a field's select; return every option it offered."""
    from playwright.sync_api import expect

    control = field.locator("button.p-select-button__control")
    expect(control).to_be_visible()
    # Prefect's select is no <select>; a click toggles it open and shut at once, the keyboard does not.
    control.focus()
    page.keyboard.press("ArrowDown")
    listbox = page.get_by_role("listbox")
    expect(listbox).to_be_visible()
    # all_inner_texts() does not wait: read the options once the one to pick is shown (CI7 read none)
    expect(listbox.get_by_role("option", name=option, exact=True)).to_be_visible()
    offered = listbox.get_by_role("option").all_inner_texts()
    listbox.get_by_role("option", name=option, exact=True).click()
    expect(field.locator(".p-select-button__value")).to_have_text(option)
    return offered


def settled_screenshot(page: Any, path: Path) -> Path:
    """No half-faded picture: wait for the page's finite animations (a spinner's never ends), 3 s at most."""
    page.evaluate(
        """Promise.race([
            Promise.all(document.getAnimations()
                .filter(a => a.effect && a.effect.getComputedTiming().iterations !== Infinity)
                .map(a => a.finished.catch(() => null))),
            new Promise(resolve => setTimeout(resolve, 3000)),
        ])"""
    )
    page.screenshot(path=str(path), full_page=True)
    return path
