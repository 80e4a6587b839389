package engine

import (
	"strconv"
	"testing"
	"testing/quick"

	"github.com/kvactors/kvactors/messages"
)

// groupEvents gives each request exactly its routed events in batch order,
// whether the batch groups them (compacted in place) or interleaves them
// (copied), with events that were not routed anywhere in between.
func TestGroupEventsKeepsEachRequestsOrder(t *testing.T) {
	check := func(reqOf []uint8, routedMask []bool) bool {
		events := make([]messages.Event, len(reqOf))
		var fwd []routed
		var counts []int
		index := map[string]int{}
		var order []string
		want := map[string][]int{}
		for i, r := range reqOf {
			id := "r" + strconv.Itoa(int(r%5))
			events[i] = messages.Event{Request: id, Start: i}
			if i < len(routedMask) && !routedMask[i] {
				continue // an added or refused event: not forwarded
			}
			idx, ok := index[id]
			if !ok {
				idx = len(order)
				index[id] = idx
				order = append(order, id)
				counts = append(counts, 0)
			}
			counts[idx]++
			fwd = append(fwd, routed{event: i, request: idx})
			want[id] = append(want[id], i)
		}
		all, inPlace := groupEvents(events, fwd, counts)
		if len(all) > 0 && inPlace != (&all[0] == &events[0]) {
			return false // inPlace must say whether all is the batch's own slice
		}
		begin := 0
		for idx, id := range order {
			part := all[begin:counts[idx]]
			begin = counts[idx]
			if len(part) != len(want[id]) {
				return false
			}
			for j, ev := range part {
				if ev.Request != id || ev.Start != want[id][j] {
					return false
				}
			}
		}
		return begin == len(fwd)
	}
	if err := quick.Check(check, &quick.Config{MaxCount: 2000}); err != nil {
		t.Fatal(err)
	}
	// Both paths, explicitly: runs (in place) and interleaved (copied).
	for _, reqs := range [][]uint8{{0, 0, 1, 1, 2}, {0, 1, 0, 2, 1}} {
		if !check(reqs, []bool{true, false, true, true, true}) {
			t.Fatalf("batch %v", reqs)
		}
	}
}
