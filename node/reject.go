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

// rejectedUnknownEngine is rejected for an engine's message the node
// refuses as of an engine it does not know, at unknownEngineLevel.
func (n *Node) rejectedUnknownEngine(msg, engineID string) {
	n.rejectedAt(n.unknownEngineLevel(), messages.RejectUnknownEngine, msg, "engine", engineID)
}

// unknownEngineLevel is the level of a refusal as of an unknown engine.
// Within the node's first lease this is every engine's first heartbeat
// after a restart, and what it sent before that heartbeat's answer
// (batches, lookups, loads, an unregister), refused unknown engine so that
// it registers again: the normal recovery path (PROTOCOL.md), Info. After
// it, an engine talking unregistered misbehaves: Error.
func (n *Node) unknownEngineLevel() slog.Level {
	if n.now().Sub(n.servingSince) < n.cfg.Lease {
		return slog.LevelInfo
	}
	return slog.LevelError
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
