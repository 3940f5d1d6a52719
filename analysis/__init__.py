"""WHAT the runs mean. At the ground floor, which every layer may import: the metrics schema,
record I/O and the migration of older records. Above it: loading runs into pandas, derived
metrics, tables, plots, the HTML report, the published study beside the user's runs, and the
scaling projection."""
