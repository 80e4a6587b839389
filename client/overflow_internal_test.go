package client

import (
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

// Each overflow resync less than a lease after the last doubles the wait,
// up to lease/4; each wait is in [½, 1] of its step; a lease without one
// starts over; a negative backoff waits not at all.
func TestOverflowWaitDoublesUpToAQuarterLease(t *testing.T) {
	t.Parallel()
	c := &Client{cfg: Config{OverflowBackoff: 10 * time.Millisecond}, lease: 8 * time.Second}
	now := time.Unix(1_800_000_000, 0)
	step := 10 * time.Millisecond
	for i := range 12 {
		c.holdLocked(now)
		wait := c.holdUntil.Sub(now)
		require.GreaterOrEqual(t, wait, step/2, "overflow %d", i+1)
		require.LessOrEqual(t, wait, step, "overflow %d", i+1)
		step = min(2*step, 2*time.Second)
		now = now.Add(time.Second)
	}
	now = now.Add(9 * time.Second)
	c.holdLocked(now)
	require.LessOrEqual(t, c.holdUntil.Sub(now), 10*time.Millisecond, "a lease later the wait starts over")

	c = &Client{cfg: Config{OverflowBackoff: 3 * time.Hour}, lease: 8 * time.Second}
	for range 40 {
		c.holdLocked(now)
		require.LessOrEqual(t, c.holdUntil.Sub(now), 2*time.Second, "a base past lease/4 is cut to it")
		now = now.Add(time.Second)
	}

	c = &Client{cfg: Config{OverflowBackoff: -1}, lease: 8 * time.Second}
	c.holdLocked(now)
	require.True(t, c.holdUntil.IsZero(), "no wait")
}
