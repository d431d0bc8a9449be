"""The release report: what a release left (evidence.py), drawn (plots.py) into one page a person reads in a minute
(page.py), written beside the gate's report and logged with the release (publish.py)."""
