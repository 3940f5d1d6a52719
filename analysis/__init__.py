"""WHAT the runs mean, in three groups: records/ (the schema and record I/O, which every layer may
import), report/ (derived metrics, tables, the verdict, plots, the HTML report) and projection/
(the step-time and memory model that recommend and project use)."""
