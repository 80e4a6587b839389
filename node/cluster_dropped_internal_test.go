package node

import (
	"fmt"
	"testing"

	"github.com/stretchr/testify/require"
)

// The set of dropped engines is bounded (the oldest go first), a claim
// forgets an engine, one read of its owner runs at a time, and a read
// that outlived a claim and a second drop does not count as the new one's.
func TestDroppedEnginesAreBoundedAndForgottenWhenClaimed(t *testing.T) {
	var d droppedEngines
	for i := range droppedEnginesMax + 10 {
		d.add(fmt.Sprint("e", i))
	}
	require.Len(t, d.ids, droppedEnginesMax)
	_, ok := d.begin("e0")
	require.False(t, ok, "the oldest was forgotten")
	gen, ok := d.begin("e10")
	require.True(t, ok)
	_, ok = d.begin("e10")
	require.False(t, ok, "one read at a time")
	require.True(t, d.end("e10", gen))
	_, ok = d.begin("e10")
	require.True(t, ok, "the next read, once the first ended")

	old, ok := d.begin("e12")
	require.True(t, ok)
	d.forget("e12") // claimed while its read ran
	_, ok = d.begin("e12")
	require.False(t, ok, "claimed again: not answered")
	d.add("e12") // and dropped again
	require.False(t, d.end("e12", old), "the first read is not the second drop's")
	_, ok = d.begin("e12")
	require.True(t, ok, "the second drop's own read may start")

	d.add("e11")
	d.forget("e11")
	d.add("e11") // dropped again: the newest
	for i := range droppedEnginesMax - 1 {
		d.add(fmt.Sprint("f", i))
	}
	_, ok = d.begin("e11")
	require.True(t, ok, "a stale ref of its first drop does not evict it")
	for range 3 * droppedEnginesMax {
		d.add("g")
		d.forget("g")
	}
	require.LessOrEqual(t, len(d.queue), 2*droppedEnginesMax+1, "refs of forgotten ids are compacted")
}
