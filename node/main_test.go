package node

import (
	"flag"
	"os"
	"runtime"
	"strconv"
	"testing"
)

// TestMain runs the package's parallel tests (those that call t.Parallel)
// at least four at a time, not GOMAXPROCS' two, unless -parallel is given
// or the race detector is on: most of them wait out leases, settle delays
// and timeouts rather than use the CPU, and at two at a time they made the
// package the suite's long pole on 2 cores. Tests that measure the heap or
// a wall-clock bound, or flood NATS within a lease, do not call t.Parallel.
func TestMain(m *testing.M) {
	flag.Parse()
	given := false
	flag.Visit(func(f *flag.Flag) { given = given || f.Name == "test.parallel" })
	if !given && !raceEnabled {
		_ = flag.Set("test.parallel", strconv.Itoa(max(4, runtime.GOMAXPROCS(0))))
	}
	os.Exit(m.Run())
}
