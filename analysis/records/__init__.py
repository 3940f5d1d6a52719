"""The ground floor of analysis, which every layer may import: the metrics schema, a run's files on
disk, the migration of older records, and loading a folder of runs into one table."""
