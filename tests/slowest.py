"""The slowest tests of a JUnit report and the time of each module, printed at the end of CI (.ci/run).

python tests/slowest.py build/junit.xml [N]
"""

from __future__ import annotations

import sys
import xml.etree.ElementTree as ET
from collections import defaultdict


def main(path: str, count: int = 10) -> None:
    cases = [
        (float(case.get("time", 0)), f"{case.get('classname', '')}::{case.get('name', '')}")
        for case in ET.parse(path).getroot().iter("testcase")
    ]
    modules: dict[str, float] = defaultdict(float)
    for seconds, name in cases:
        parts = name.split("::")[0].split(".")  # tests.unit.test_store[.SomeClass]
        module = next((i for i, part in enumerate(parts) if part.startswith("test_")), len(parts) - 1)
        modules[".".join(parts[: module + 1])] += seconds
    print(f"ci: the {count} slowest of {len(cases)} tests ({sum(s for s, _ in cases):.0f} s of tests in all)")
    for seconds, name in sorted(cases, reverse=True)[:count]:
        print(f"ci: {seconds:8.1f} s  {name}")
    print("ci: seconds per module")
    for module, seconds in sorted(modules.items(), key=lambda item: -item[1]):
        print(f"ci: {seconds:8.1f} s  {module}")


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 10)
