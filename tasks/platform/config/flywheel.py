"""The flywheel's admission of harvested data (flows/flywheel.py): a person reviews each harvest, or rules that no
single client can game admit it unreviewed."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from tasks.platform.config.base import TRUST_ONLY, Section


class FlywheelSection(Section):
    """How a harvest of served traffic becomes training data. It always lands first in a pending location with a
    report (per-client counts and shares, corrections beside the answers they replace); from there only an
    approval, or with review `rules` the rules below, moves it where retraining watches."""

    review: Literal["person", "rules"] = Field(
        "person",
        description="person: every harvest waits for an approval (the flywheel run's Resume form in the Prefect UI, "
        "or `llmops approve RUN_ID`). rules: a harvest that keeps the rules (corrections only from "
        "serve.capture.trusted_clients, no client above max_client_share, at least min_clients clients, no "
        "client-written system turn) is pushed unreviewed, one that breaks one waits for a person; needs "
        "serve.capture.trusted_clients, train.mask_history and data.eval_source.",
        json_schema_extra=TRUST_ONLY,
    )
    max_client_share: float = Field(
        0.05,
        gt=0,
        le=1,
        description="review rules: the largest share of a harvest's records one client may have contributed.",
        json_schema_extra=TRUST_ONLY,
    )
    min_clients: int = Field(
        20,
        ge=1,
        description="review rules: fewest distinct clients a harvest's records must come from.",
        json_schema_extra=TRUST_ONLY,
    )
    report_samples: int = Field(
        10, ge=0, description="Corrections shown in the report beside the served answers they replace."
    )
