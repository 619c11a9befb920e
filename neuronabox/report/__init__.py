"""What users read: tables, summaries, plots."""
