"""WHAT the runs mean: the metrics schema, reading records, and (later) tables, plots, reports."""
