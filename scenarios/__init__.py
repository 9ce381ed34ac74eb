"""Scenario modules; shipped inside the installed package as `mpsimpact.scenarios`."""
