package node

// Refused input: counted per reason, logged at a limited rate, and nothing
// else changed.

import (
	"errors"
	"log/slog"

	"github.com/kvactors/kvactors/messages"
)

// rejected counts and logs one refused input; nothing else changes. The log
// is rate-limited per reason (ratelog), the counter counts every one.
func (n *Node) rejected(reason, msg string, args ...any) {
	n.metrics.Rejected.WithLabelValues(reason).Inc()
	n.rejectLog.Reject(reason, msg, args...)
}

// rejectedAt is rejected at another level than Error, for a refusal
// that is expected at times (still counted and rate-limited the same).
func (n *Node) rejectedAt(level slog.Level, reason, msg string, args ...any) {
	n.metrics.Rejected.WithLabelValues(reason).Inc()
	n.rejectLog.Log(level, reason, msg, args...)
}

// rejectedN is rejected for count refused inputs that one line reports.
func (n *Node) rejectedN(reason string, count int, msg string, args ...any) {
	n.metrics.Rejected.WithLabelValues(reason).Add(float64(count))
	n.rejectLog.RejectN(reason, count, msg, args...)
}

var (
	// errUnknownEngine is counted unknown_engine wherever its label is
	// taken from the error (a lookup's, a load's).
	errUnknownEngine = messages.NewRejection(messages.RejectUnknownEngine, "unknown engine")
	errClosing       = errors.New("node closing")
	errOverloaded    = errors.New(messages.Overloaded + ": inbound queue full, try again")
)
