"""The Prefect UI in a real browser: Debian's Chromium (installed by infra/local/test-tools.sh) driven by
Playwright, which downloads no browser of its own. Used by the service tests to start a run from a
deployment's "Custom run" form as a person does, and to look at what the page shows."""

from __future__ import annotations

import json
import urllib.request
from dataclasses import dataclass
from pathlib import Path

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


@dataclass
class FormRun:
    flow_run: dict  # the create_flow_run response: id, name, parameters
    offered_profiles: list[str]  # the choices the form's profile select offered
    screenshot: Path


def ui_api_url(ui_url: str) -> str:
    """Where the UI served at ui_url sends its API calls (its /ui-settings)."""
    with urllib.request.urlopen(f"{ui_url}/ui-settings", timeout=10) as response:
        return json.loads(response.read())["api_url"]


def start_run_from_form(
    ui_url: str, deployment_id: str, profile: str, data_source: str, overrides: list[str], screenshots: Path
) -> FormRun:
    """Open the deployment's run page, choose the profile, type the data source and overrides, press
    Submit; return the run the UI created (read from the UI's own create_flow_run response)."""
    from playwright.sync_api import expect, sync_playwright

    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS, headless=True)
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 1100})
            page.set_default_timeout(30_000)
            page.goto(f"{ui_url}/deployments/deployment/{deployment_id}/run")

            def parameter(name: str):
                # Labels read "profile (Optional)"; their `for` points at nothing get_by_label can use.
                return page.locator(".schema-form-property").filter(
                    has=page.locator(".schema-form-property__label", has_text=f"{name} (")
                )

            expect(page.get_by_role("heading", name="Parameters")).to_be_visible()
            expect(page.get_by_text("Oops. Something went wrong")).to_have_count(0)
            choice = parameter("profile").locator("button.p-select-button__control")
            expect(choice).to_be_visible()
            # Prefect's select is no <select>; a click toggles it open and shut at once, the keyboard does not.
            choice.focus()
            page.keyboard.press("ArrowDown")
            listbox = page.get_by_role("listbox")
            expect(listbox).to_be_visible()
            # all_inner_texts() does not wait: read the options once the one to pick is shown (CI7 read none)
            expect(listbox.get_by_role("option", name=profile, exact=True)).to_be_visible()
            offered = listbox.get_by_role("option").all_inner_texts()
            listbox.get_by_role("option", name=profile, exact=True).click()
            expect(parameter("profile").locator(".p-select-button__value")).to_have_text(profile)

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
            # No half-faded picture: wait for the page's finite animations (a spinner's never ends), 3 s at most.
            page.evaluate(
                """Promise.race([
                    Promise.all(document.getAnimations()
                        .filter(a => a.effect && a.effect.getComputedTiming().iterations !== Infinity)
                        .map(a => a.finished.catch(() => null))),
                    new Promise(resolve => setTimeout(resolve, 3000)),
                ])"""
            )
            screenshot = screenshots / "run-form.png"
            page.screenshot(path=str(screenshot), full_page=True)

            with page.expect_response(
                lambda r: r.request.method == "POST" and r.url.endswith(f"/deployments/{deployment_id}/create_flow_run")
            ) as created:
                page.get_by_role("button", name="Submit", exact=True).click()
            response = created.value
            assert response.status == 201, (response.status, response.text())
            flow_run = response.json()
            # The UI goes back to the deployment and says the run is scheduled.
            expect(page.locator(".toast-flow-run-create__message", has_text=flow_run["name"]).first).to_be_visible()
            expect(page.get_by_text("Oops. Something went wrong")).to_have_count(0)
            return FormRun(flow_run, offered, screenshot)
        finally:
            browser.close()
