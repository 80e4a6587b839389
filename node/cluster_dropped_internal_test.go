package node

import (
	"fmt"
	"testing"

	"github.com/stretchr/testify/require"
)

// The set of dropped engines is bounded (the oldest go first), a claim
// forgets an engine, and one read of its owner at a time holds its replies.
func TestDroppedEnginesAreBoundedAndForgottenWhenClaimed(t *testing.T) {
	var d droppedEngines
	for i := range droppedEnginesMax + 10 {
		d.add(fmt.Sprint("e", i))
	}
	require.Len(t, d.ids, droppedEnginesMax)
	_, queued := d.await("e0", "r")
	require.False(t, queued, "the oldest was forgotten")
	start, queued := d.await("e10", "r1")
	require.True(t, start && queued)
	start, queued = d.await("e10", "r2")
	require.True(t, queued)
	require.False(t, start, "one read at a time")
	require.Equal(t, []string{"r1", "r2"}, d.done("e10"))

	d.forget("e11")
	_, queued = d.await("e11", "r")
	require.False(t, queued, "claimed again: not answered")
	d.add("e11") // dropped again: the newest
	for i := range droppedEnginesMax - 1 {
		d.add(fmt.Sprint("f", i))
	}
	_, queued = d.await("e11", "r")
	require.True(t, queued, "a stale ref of its first drop does not evict it")
	for range 3 * droppedEnginesMax {
		d.add("g")
		d.forget("g")
	}
	require.LessOrEqual(t, len(d.queue), 2*droppedEnginesMax+1, "refs of forgotten ids are compacted")
}
