"""`llmops profiles list|show|validate|autoscaler`: the run profiles of profiles/, without running anything."""

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
    text = (
        "print the KEDA ScaledObject that scales this profile's Tritons on Kubernetes by its serve.autoscale (the "
        "Deployment of `llmops triton` pods in infra/kubernetes/serving-autoscale.yaml, read from Prometheus)"
    )
    autoscaler = actions.add_parser("autoscaler", help=text.split(" (")[0], description=text.capitalize() + ".")
    autoscaler.add_argument("profile", help="profile name or YAML path")
    add_overrides_flag(autoscaler, "override a profile value (repeatable), e.g. serve.autoscale.signal=ttft_p90")
    autoscaler.add_argument(
        "--prometheus", default=None, help="the Prometheus KEDA queries (default http://prometheus.monitoring.svc:9090)"
    )
    autoscaler.set_defaults(handler=show_autoscaler)


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


def show_autoscaler(args) -> None:
    import yaml

    from tasks.platform.config import load_profile
    from tasks.serving.kubernetes import PROMETHEUS, scaled_object

    rendered = scaled_object(load_profile(args.profile, args.overrides), args.prometheus or PROMETHEUS)
    print(yaml.safe_dump(rendered, sort_keys=False), end="")
