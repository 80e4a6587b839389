package ratelog

import (
	"bytes"
	"log/slog"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

// The first burst per reason per window is logged; the rest are summarised
// once the window is over; reasons are independent.
func TestLimiterBurstThenSummary(t *testing.T) {
	l := New(3, time.Minute)
	t0 := time.Unix(1000, 0)
	logged := 0
	for i := range 1000 {
		log, sum := l.Allow("too_large", t0.Add(time.Duration(i)*time.Millisecond))
		require.Zero(t, sum, "no summary within the window")
		if log {
			logged++
		}
	}
	require.Equal(t, 3, logged)
	log, _ := l.Allow("bad_spec", t0.Add(time.Second))
	require.True(t, log, "another reason has its own burst")

	log, sum := l.Allow("too_large", t0.Add(time.Minute))
	require.True(t, log, "a new window logs again")
	require.Equal(t, 997, sum, "the ended window's unlogged rejections, once")
	_, sum = l.Allow("too_large", t0.Add(time.Minute+time.Second))
	require.Zero(t, sum)
}

// A clock that steps back starts a new window rather than muting forever.
func TestLimiterClockBack(t *testing.T) {
	l := New(1, time.Minute)
	t0 := time.Unix(1000, 0)
	l.Allow("r", t0)
	log, _ := l.Allow("r", t0)
	require.False(t, log)
	log, sum := l.Allow("r", t0.Add(-time.Hour))
	require.True(t, log)
	require.Equal(t, 1, sum)
}

// The point of the package: a flood of N rejections writes O(reasons)
// lines, not O(N).
func TestLogFloodIsBounded(t *testing.T) {
	var buf bytes.Buffer
	log := NewLog(slog.New(slog.NewTextHandler(&buf, nil)), New(5, time.Minute))
	clock := time.Unix(0, 0)
	log.now = func() time.Time { return clock }
	for i := range 100_000 {
		log.Reject("too_large", "event rejected", "i", i)
		clock = clock.Add(time.Millisecond) // 100 s in all: two windows
	}
	lines := strings.Count(buf.String(), "\n")
	require.Equal(t, 5+1+5, lines, "5 lines, the first window's summary, 5 lines:\n%s", buf.String())
	require.Contains(t, buf.String(), "suppressed=59995")
	var nilLog *Log
	nilLog.Reject("x", "nothing") // a nil Log is silent, not a panic
}

// Flush reports a window that is over without waiting for that reason's next
// rejection, once, and only for reasons with something unlogged.
func TestFlushEndsWindowsThatAreOver(t *testing.T) {
	var buf bytes.Buffer
	log := NewLog(slog.New(slog.NewTextHandler(&buf, nil)), New(1, time.Minute))
	clock := time.Unix(0, 0)
	log.now = func() time.Time { return clock }
	for range 10 {
		log.Reject("a", "rejected")
	}
	log.Reject("b", "rejected") // within its burst: nothing to summarise
	log.Flush()
	require.NotContains(t, buf.String(), "suppressed", "the window is not over")
	clock = clock.Add(time.Minute)
	log.Flush()
	require.Contains(t, buf.String(), "reason=a suppressed=9")
	require.NotContains(t, buf.String(), "reason=b suppressed")
	n := strings.Count(buf.String(), "\n")
	log.Flush()
	require.Equal(t, n, strings.Count(buf.String(), "\n"), "once")
	var nilLog *Log
	nilLog.Flush()
}

// A line that reports many rejections (RejectN: a batch's summary of them)
// takes one place of the burst when logged, and counts all of them in the
// window's summary when not: suppressed stays a count of rejections.
func TestRejectNCountsEveryRejectionItReports(t *testing.T) {
	var buf bytes.Buffer
	log := NewLog(slog.New(slog.NewTextHandler(&buf, nil)), New(2, time.Minute))
	clock := time.Unix(0, 0)
	log.now = func() time.Time { return clock }
	log.RejectN("wrong_type", 100, "more events rejected", "count", 100)
	log.Reject("wrong_type", "event rejected")
	log.RejectN("wrong_type", 40, "more events rejected", "count", 40) // over the burst
	log.Reject("wrong_type", "event rejected")                         // and one more
	require.Equal(t, 2, strings.Count(buf.String(), "\n"), "the burst: one summary line, one event:\n%s", buf.String())
	require.Contains(t, buf.String(), "count=100")
	clock = clock.Add(time.Minute)
	log.Flush()
	require.Contains(t, buf.String(), "reason=wrong_type suppressed=41")
}
