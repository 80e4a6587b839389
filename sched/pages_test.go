package sched

import (
	"testing"

	"github.com/kvactors/kvactors/hostpool"
)

// A set within the pool's bytes may need more pages than it has (each
// page of 64-byte slots wastes 20 of its 340 bytes): a cap by bytes left
// such a request whole, refused at every retry until it gave all its
// chunks up.
func TestARequestWithinThePoolsBytesButNotItsPagesIsStoredInParts(t *testing.T) {
	lay := layout(t, 4, 1, full(4)) // 64-byte chunks
	h := newHarness(t, lay, 8, added(84))
	h.pool = hostpool.New(4*340, 340) // 4 pages of 340 B: 5 chunks a page (20 B spare), 1360 B
	h.step(hashes(0, 21), blocks(0, 0, seq(1, 21)...), tokens(84, 84), finished(84, 84))
	given, jobs := 0, 0
	for i := 0; i < 40; i++ {
		e := h.advance()
		given += e.GivenUp
		if e.Job != nil {
			jobs++
			h.done(e.Job.ID, true)
			continue
		}
		if given > 0 || (e.Retry == nil && !e.More) {
			break
		}
	}
	t.Logf("jobs %d, stored %d chunks, given up %d", jobs, len(h.stored), given)
	if len(h.stored) != 21 || given != 0 || jobs != 2 {
		t.Fatalf("a 1344 B request through an empty pool of 4 pages holding 5 chunks each: stored %d chunks in %d jobs, given up %d; want 21 in 2 (20, then 1), none given up",
			len(h.stored), jobs, given)
	}
}
