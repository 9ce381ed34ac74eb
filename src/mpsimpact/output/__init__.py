"""Leaves every layer above the modes may use: files written atomically, the house look of pages and
tables, and figures as PNG bytes. Nothing here knows about runs, models or faults."""
