// Package cpuacct measures where CPU time goes during a benchmark trial:
// the busy time of one CPU from /proc/stat (everything that ran there,
// softirqs included, in USER_HZ ticks) and the exact run time of chosen
// threads from /proc/<tid>/schedstat (nanoseconds), which stays correct
// when other work shares the machine.
package cpuacct
