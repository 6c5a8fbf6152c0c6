// Package report holds the results of one benchmark run and writes them to
// a results directory: CSV files (one row per measurement), a markdown
// report with the tables and the verdict on each target, and PNG plots
// drawn with gonum.org/v1/plot (throughput against number of services,
// loss against offered load, TCP latency distribution).
//
// The package computes nothing it was not given except ratios for the
// targets; every number in the report comes from a Run filled by the
// benchmark driver.
package report
