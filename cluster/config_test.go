package cluster

import (
	"errors"
	"testing"
	"time"
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
