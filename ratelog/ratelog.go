package ratelog

import (
	"context"
	"log/slog"
	"sync"
	"time"
)

// Defaults: five lines per reason, then one summary per minute.
const (
	DefaultBurst  = 5
	DefaultWindow = time.Minute
)

// Limiter decides, per reason, which rejections are logged. It is safe for
// concurrent use. The zero value is not usable; call New.
type Limiter struct {
	burst  int
	window time.Duration

	mu      sync.Mutex
	reasons map[string]*reason
}

type reason struct {
	start      time.Time // of the current window
	logged     int       // lines logged in full in this window
	suppressed int       // rejections not logged in this window
}

// New returns a limiter that logs burst rejections per reason per window
// (burst < 1 or window <= 0 take the defaults).
func New(burst int, window time.Duration) *Limiter {
	if burst < 1 {
		burst = DefaultBurst
	}
	if window <= 0 {
		window = DefaultWindow
	}
	return &Limiter{burst: burst, window: window, reasons: map[string]*reason{}}
}

// Allow records one rejection of reason at now. log says whether to log it
// in full; summary > 0 says that the previous window of this reason ended
// with summary rejections unlogged, to be reported in one line (before this
// one, if it is logged). The number of reasons must be bounded by the caller
// (they are metric labels).
func (l *Limiter) Allow(r string, now time.Time) (log bool, summary int) {
	return l.AllowN(r, 1, now)
}

// AllowN is Allow for n rejections that one line reports (a batch's
// summary of them): logged, the line takes one place of the burst; not,
// all n count as unlogged, so the window's summary stays a count of
// rejections.
func (l *Limiter) AllowN(r string, n int, now time.Time) (log bool, summary int) {
	l.mu.Lock()
	defer l.mu.Unlock()
	st := l.reasons[r]
	if st == nil {
		st = &reason{start: now}
		l.reasons[r] = st
	}
	if now.Sub(st.start) >= l.window || now.Before(st.start) {
		summary = st.suppressed
		*st = reason{start: now}
	}
	if st.logged < l.burst {
		st.logged++
		return true, summary
	}
	st.suppressed += n
	return false, summary
}

// Flush ends, at now, every reason's window that is over and returns how
// many rejections each left unlogged (reasons with none are left out), so a
// summary is not held back until that reason's next rejection.
func (l *Limiter) Flush(now time.Time) map[string]int {
	l.mu.Lock()
	defer l.mu.Unlock()
	var out map[string]int
	for r, st := range l.reasons {
		if st.suppressed > 0 && (now.Sub(st.start) >= l.window || now.Before(st.start)) {
			if out == nil {
				out = map[string]int{}
			}
			out[r] = st.suppressed
			*st = reason{start: now}
		}
	}
	return out
}

// Log is a logger for rejections that goes through a Limiter.
type Log struct {
	log *slog.Logger
	lim *Limiter
	now func() time.Time
}

// NewLog wraps log with lim (nil: New(0, 0)).
func NewLog(log *slog.Logger, lim *Limiter) *Log {
	if lim == nil {
		lim = New(0, 0)
	}
	return &Log{log: log, lim: lim, now: time.Now}
}

// Reject logs one rejection of reason at error level, unless the limiter
// suppresses it; a summary line comes first when a window just ended with
// lines suppressed. A nil *Log logs nothing.
func (r *Log) Reject(reason, msg string, args ...any) {
	r.Log(slog.LevelError, reason, msg, args...)
}

// RejectN is Reject for one line that reports n rejections of reason (a
// summary of them: its args should say n).
func (r *Log) RejectN(reason string, n int, msg string, args ...any) {
	r.logN(slog.LevelError, reason, n, msg, args...)
}

// Log is Reject at another level, for input-driven lines that are not
// errors (a load that misses, say) but could flood the log all the same.
func (r *Log) Log(level slog.Level, reason, msg string, args ...any) {
	r.logN(level, reason, 1, msg, args...)
}

func (r *Log) logN(level slog.Level, reason string, n int, msg string, args ...any) {
	if r == nil {
		return
	}
	log, summary := r.lim.AllowN(reason, n, r.now())
	if summary > 0 {
		r.summary(reason, summary)
	}
	if log {
		r.log.Log(context.Background(), level, msg, append(args, "reason", reason)...)
	}
}

// Flush writes the summary line of every reason whose window is over with
// rejections unlogged; call it periodically (the node does, every lease/4).
// A nil *Log does nothing.
func (r *Log) Flush() {
	if r == nil {
		return
	}
	for reason, n := range r.lim.Flush(r.now()) {
		r.summary(reason, n)
	}
}

func (r *Log) summary(reason string, suppressed int) {
	r.log.LogAttrs(context.Background(), slog.LevelWarn, "rejections not logged (rate limit)",
		slog.String("reason", reason), slog.Int("suppressed", suppressed), slog.Duration("window", r.lim.window))
}
