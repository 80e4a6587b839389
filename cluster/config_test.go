package cluster

import (
	"errors"
	"testing"
	"time"

	"github.com/kvactors/kvactors/cluster/ownership"
)

func TestClockSkewDefaultsToATenthOfTheLeaseAndIsBounded(t *testing.T) {
	c := Config{Node: "n", Boot: "b", Lease: 10 * time.Second}
	if err := c.Validate(); err != nil {
		t.Fatal(err)
	}
	if c.ClockSkew != time.Second || c.ServeFor() != 9*time.Second {
		t.Fatalf("skew %v, serve for %v; want 1s and 9s at a 10 s lease", c.ClockSkew, c.ServeFor())
	}
	for _, skew := range []time.Duration{-time.Millisecond, 5*time.Second + time.Millisecond} {
		c := Config{Node: "n", Boot: "b", Lease: 10 * time.Second, ClockSkew: skew}
		if err := c.Validate(); !errors.Is(err, ErrConfig) {
			t.Errorf("clock skew %v: %v, want ErrConfig", skew, err)
		}
	}
}

// Serving ends the clock skew before a lease from the last write sent
// (ownership.Decide's rule, the one the copies' gate reads).
func TestServingEndsTheSkewBeforeTheLease(t *testing.T) {
	c := Config{Node: "n", Boot: "b", Lease: 10 * time.Second}
	if err := c.Validate(); err != nil {
		t.Fatal(err)
	}
	now := time.Now()
	o := &Owners{cfg: c, mine: map[string]held{
		"within": {renewed: now.Add(-8 * time.Second)},
		"past":   {renewed: now.Add(-9*time.Second - time.Millisecond)},
	}}
	if !o.Serving("within", now) {
		t.Error("an engine renewed 8 s ago not served at a 10 s lease and 1 s skew")
	}
	if o.Serving("past", now) {
		t.Error("an engine renewed 9.001 s ago served at a 10 s lease and 1 s skew: a server 1 s ahead may have expired it")
	}
}

// A read of this process's own closed marker (Leave's) past the claim's
// revision is no renewal, though it names this identity and a write of the
// claim is in flight: every other node takes it for no owner at once, so
// counted as landed it would keep this node serving, and its fencing
// token on the marker, while another claims it (claim's rule too).
func TestAClosedMarkerOfItsOwnIsNoRenewal(t *testing.T) {
	c := Config{Node: "n", Boot: "b", Lease: 10 * time.Second}
	if err := c.Validate(); err != nil {
		t.Fatal(err)
	}
	now := time.Now()
	me := ownership.Identity{Node: "n", Boot: "b"}
	o := &Owners{cfg: c, me: me, mine: map[string]held{
		"e": {rev: 5, renewed: now.Add(-8 * time.Second), unacked: now},
	}}
	marker := &ownership.Entry{Record: ownership.Record{Identity: me, LeaseMS: 10000, Renewed: now.UnixMilli(), Closed: true},
		Revision: 7}
	o.input("e", marker, Request{})
	if rev := o.Revision("e"); rev != 5 {
		t.Errorf("the claim's token is %d after a read of its own closed marker at 7, want 5", rev)
	}
	if o.Serving("e", now.Add(2*time.Second)) {
		t.Error("served on its own closed marker")
	}
}
