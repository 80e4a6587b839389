package actors

import (
	"log/slog"

	"github.com/asynkron/protoactor-go/actor"
)

// StopOnPanic is the strategy of a parent whose children hold state a fresh
// instance could not rebuild (protoactor's default restart calls the producer
// again and loses every field). The failed child is stopped; the parent sees
// *actor.Terminated and cleans up (a request is released once its copies
// are drained, counted, logged).
func StopOnPanic(log *slog.Logger) actor.SupervisorStrategy {
	return &stopStrategy{log: log}
}

type stopStrategy struct{ log *slog.Logger }

func (s *stopStrategy) HandleFailure(_ *actor.ActorSystem, sup actor.Supervisor, child *actor.PID,
	_ *actor.RestartStatistics, reason, message any) {
	s.log.Error("actor failed; stopping it", "actor", child.Id, "reason", reason, "message", message)
	sup.StopChildren(child)
}
