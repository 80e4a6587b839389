package ingest

import (
	"fmt"
	"runtime"
	"slices"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/kvactors/kvactors/messages"
)

// junkKinds are rejected events of each reason the decoder gives, as an
// engine might send them by the thousand.
var junkKinds = []struct{ event, reason string }{
	{`1`, messages.RejectWrongType},
	{`{"type":"zz","request":"r"}`, messages.RejectUnknownType},
	{`{"type":"resumed","request":""}`, messages.RejectBadRequestID},
	{`{"type":"blocks","request":"r","ids":[-1]}`, messages.RejectOutOfRange},
	{`{"type":"hashes","request":"r","hashes":["0G"]}`, messages.RejectBadHash},
	{`{"type":"hashes","request":"r","hashes":["00","00","00"]}`, messages.RejectTooLarge},
}

// A batch of 1,000 junk events around good ones: the first
// DetailedEventErrors rejections are reported one by one with the message
// each event gets alone; the rest in one summary per reason with its static
// error; the Counts add up, per reason, to every rejected event, once; the
// good events are decoded unchanged and in order.
func TestDecodeBatchDetailsOnlyTheFirstRejections(t *testing.T) {
	lim := Limits{MaxIDs: 2}
	var (
		elems      []string
		good       []messages.Event
		want       = map[string]int{}
		junkIdx    []int              // element index of each junk event, in order
		firstAfter = map[string]int{} // per reason: its first junk event past the detailed ones
	)
	for i := range 1000 {
		if i%50 == 7 {
			id := fmt.Sprintf("g%d", i)
			elems = append(elems, `{"type":"resumed","request":"`+id+`"}`)
			good = append(good, messages.Event{Type: messages.EvResumed, Request: id})
		}
		k := junkKinds[(i*7)%len(junkKinds)]
		if len(junkIdx) >= DetailedEventErrors {
			if _, ok := firstAfter[k.reason]; !ok {
				firstAfter[k.reason] = len(elems)
			}
		}
		junkIdx = append(junkIdx, len(elems))
		elems = append(elems, k.event)
		want[k.reason]++
	}
	body := `{"epoch":"e","seq":1,"events":[` + strings.Join(elems, ",") + `]}`
	b, bad, err := DecodeBatch("e1", []byte(body), lim)
	require.NoError(t, err)
	require.Equal(t, good, b.Events, "the good events, unchanged and in order")

	got := map[string]int{}
	for _, e := range bad {
		require.ErrorIs(t, e, ErrBadEvent)
		got[messages.RejectLabel(e)] += e.Count
	}
	require.Equal(t, want, got, "every rejected event counted once, under its reason")

	require.Greater(t, len(bad), DetailedEventErrors)
	for i, e := range bad[:DetailedEventErrors] {
		ev := elems[junkIdx[i]]
		_, alone, err := DecodeBatch("e1", []byte(`{"epoch":"e","seq":1,"events":[`+ev+`]}`), lim)
		require.NoError(t, err)
		require.Len(t, alone, 1)
		require.Equal(t, 1, e.Count)
		require.Equal(t, junkIdx[i], e.Index)
		require.Equal(t, alone[0].Type, e.Type, "event %d", i)
		require.Equal(t, alone[0].Request, e.Request, "event %d", i)
		require.Equal(t, alone[0].Err.Error(), e.Err.Error(), "event %d: the detailed message", i)
		require.NotContains(t, e.Err.Error(), "details are given")
	}
	summaries := bad[DetailedEventErrors:]
	require.Equal(t, len(junkKinds), len(summaries), "one summary per reason")
	for _, e := range summaries {
		reason := messages.RejectLabel(e)
		require.Equal(t, firstAfter[reason], e.Index, "%s: the index of the first event it counts", reason)
		require.Empty(t, e.Type)
		require.Empty(t, e.Request)
		require.Contains(t, e.Err.Error(), "details are given for the first 16 rejected events of a batch only")
		require.Contains(t, e.Error(), fmt.Sprintf("%d events from index %d on", e.Count, e.Index))
	}
	// The summaries' errors are the same values for every batch: nothing
	// was built for their events.
	_, again, err := DecodeBatch("e1", []byte(body), lim)
	require.NoError(t, err)
	for i, e := range summaries {
		require.Same(t, e.Err, again[DetailedEventErrors+i].Err)
	}
}

// A body of junk events (`1,` each: two bytes) must not cost memory per
// event: each one was about 500 bytes of error text and six allocations,
// 32 MB for a 131 KB body the intake byte budget counts as 131 KB. The
// decoder's allocations must not grow with the junk, and all it allocates
// for a full batch of it stays under the body's own size.
func TestJunkEventsCostNoMemoryEach(t *testing.T) {
	const many = 1 << 16 // Limits.MaxEvents
	small, big := junkBody(64), junkBody(many)
	decode := func(body []byte) func() {
		return func() {
			if _, _, err := DecodeBatch("e1", body, Limits{}); err != nil {
				t.Fatal(err)
			}
		}
	}
	base := medianAllocs(31, decode(small))
	allocs := medianAllocs(31, decode(big))
	require.LessOrEqual(t, allocs, base+8, "allocations for %d junk events, against %v for 64", many, base)

	const runs = 10
	var before, after runtime.MemStats
	runtime.ReadMemStats(&before)
	for range runs {
		decode(big)()
	}
	runtime.ReadMemStats(&after)
	perBatch := (after.TotalAlloc - before.TotalAlloc) / runs
	require.Less(t, perBatch, uint64(len(big)), "bytes allocated per batch of %d junk events (%.1f per event), body %d bytes",
		many, float64(perBatch)/many, len(big))
}

// medianAllocs is the median of f's heap allocations over runs calls, after
// one to warm up. Not testing.AllocsPerRun's mean: under -race sync.Pool
// drops a quarter of what it is given, so a decode's count varies by run
// (108-144 for the same body, where it is 102 without -race), and the
// means of two bodies' 20 runs came 9 apart (126 against 117) in one
// -race run of the suite.
func medianAllocs(runs int, f func()) uint64 {
	f()
	counts := make([]uint64, runs)
	var before, after runtime.MemStats
	for i := range counts {
		runtime.ReadMemStats(&before)
		f()
		runtime.ReadMemStats(&after)
		counts[i] = after.Mallocs - before.Mallocs
	}
	slices.Sort(counts)
	return counts[runs/2]
}
