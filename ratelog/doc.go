// Package ratelog bounds how much a stream of rejected inputs can log
// (PROTOCOL.md "Isolation", bounds): per reason, the first few rejections of
// each minute are logged in full, the rest are only counted and reported by
// one summary line when the minute is over. Input an attacker controls can
// therefore cost at most a few lines per reason per minute, never gigabytes
// of logs; the metric counters still count every rejection.
//
// Limiter is the pure decision (the time is passed in); Log wraps it around
// a *slog.Logger with the wall clock.
package ratelog
