package testkit

import (
	"fmt"
	"time"
	"unsafe"
)

// WallStepped is t with its wall clock moved by step and its monotonic
// reading kept: what time.Now returns after an NTP step, a slew's catch-up
// or a resumed VM moved the system clock by step. The time package has no
// way to make one (Add moves both clocks, Round(0) drops the monotonic
// reading), so it is built from time.Time's layout (go1.9 on: wall holds a
// monotonic flag, 33 bits of seconds since 1885 and 30 of nanoseconds; ext
// the monotonic reading), and checked: it panics if the result does not
// behave so (a layout that changed), rather than let a test pass that
// injected nothing. t must carry a monotonic reading (time.Now's).
func WallStepped(t time.Time, step time.Duration) time.Time {
	const (
		hasMonotonic = 1 << 63
		nsecMask     = 1<<30 - 1
		nsecShift    = 30
	)
	type layout struct {
		wall uint64
		ext  int64
		loc  *time.Location
	}
	out := t
	p := (*layout)(unsafe.Pointer(&out))
	if p.wall&hasMonotonic == 0 {
		panic("testkit.WallStepped: t has no monotonic reading")
	}
	ns := int64(p.wall<<1>>(nsecShift+1))*int64(time.Second) + int64(p.wall&nsecMask) + int64(step)
	p.wall = hasMonotonic | uint64(ns/int64(time.Second))<<nsecShift | uint64(ns%int64(time.Second))
	if out.Sub(t) != 0 || out.Round(0).Sub(t.Round(0)) != step {
		panic(fmt.Sprintf("testkit.WallStepped: built %v from %v (step %v): time.Time's layout changed", out, t, step))
	}
	return out
}
