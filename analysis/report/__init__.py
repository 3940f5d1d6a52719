"""What ``kanscale analyze`` makes of the records: derived metrics, tables, the verdict, plots, the
published study and recommend's predictions beside the runs, and the HTML report."""
