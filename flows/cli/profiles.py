"""`llmops profiles list|show|validate`: the run profiles of profiles/, without running anything."""

from __future__ import annotations

from flows.cli.common import add_overrides_flag

PLAN_NOTE = (
    " A profile with base_model.architecture on cuda is also planned: per-GPU memory of training and of the"
    " canary, refused (exit 2) where it cannot fit, naming the term that overflows."
)


def register(commands) -> None:
    profiles = commands.add_parser(
        "profiles", help="list, show or validate profiles", description="Inspect the run profiles in profiles/."
    )
    actions = profiles.add_subparsers(dest="action", required=True, metavar="ACTION")
    actions.add_parser(
        "list", help="list the available profiles", description="List profiles with their descriptions."
    ).set_defaults(handler=list_profiles)
    for action, text, handler in (
        ("show", "print a profile with every default filled in", show_profile),
        ("validate", "check a profile (and overrides) without running anything", validate_profile),
    ):
        sub = actions.add_parser(action, help=text, description=text.capitalize() + "." + PLAN_NOTE)
        sub.add_argument("profile", help="profile name or YAML path")
        add_overrides_flag(sub, "override a profile value (repeatable)")
        sub.set_defaults(handler=handler)


def list_profiles(args) -> None:
    from tasks.platform.config import available_profiles, load_profile

    for name in available_profiles():
        profile = load_profile(name)
        print(f"{name:28} {profile.hardware.accelerator:5} {profile.description}")


def show_profile(args) -> None:
    from tasks.platform.config import describe_profile, load_profile
    from tasks.training.memory_plan import memory_plan

    profile = load_profile(args.profile, args.overrides)
    plans = memory_plan(profile)
    print(describe_profile(profile), end="")
    if plans:  # YAML comments: the shown profile stays valid YAML
        print("\n# memory per GPU, planned from base_model.architecture (tasks/training/memory_plan.py):")
        print("\n".join(f"# {line}" for plan in plans for line in plan.lines()))


def validate_profile(args) -> None:
    from tasks.platform.config import load_profile
    from tasks.training.memory_plan import memory_plan

    profile = load_profile(args.profile, args.overrides)
    plans = memory_plan(profile)
    print(f"profile {profile.name}: valid (digest {profile.digest[:12]})")
    for plan in plans:
        print(plan.lines()[0])
