package testkit

import (
	"testing"
	"time"
)

func TestWallSteppedMovesTheWallClockOnly(t *testing.T) {
	now := time.Now()
	for _, step := range []time.Duration{time.Hour, -time.Hour, 1500 * time.Millisecond, -time.Nanosecond} {
		s := WallStepped(now, step)
		if d := s.Sub(now); d != 0 {
			t.Errorf("step %v: monotonic difference %v, want 0", step, d)
		}
		if d := s.Round(0).Sub(now.Round(0)); d != step {
			t.Errorf("step %v: wall difference %v", step, d)
		}
		if d := s.Add(time.Second).Sub(now); d != time.Second {
			t.Errorf("step %v: a second later reads %v", step, d)
		}
	}
}
