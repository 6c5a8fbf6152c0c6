package kubeproxy

import "strconv"

// pinned prefixes argv with taskset so that every thread of the program
// runs on cpu; a negative cpu leaves it unpinned.
func pinned(cpu int, argv ...string) []string {
	if cpu < 0 {
		return argv
	}
	return append([]string{"taskset", "-c", strconv.Itoa(cpu)}, argv...)
}
