package actors

import (
	"fmt"
	"log/slog"
	"runtime/debug"

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

// ResumeOnPanic is the guardian strategy of an actor spawned from the root
// whose state a restart would lose (protoactor's default for a guardian
// restarts: the producer again, every field gone). A failed actor is
// logged under msg with the panic's stack (protoactor escalates to a
// guardian synchronously, on the panicking goroutine, so debug.Stack is
// the panic's), resumed with its state, and, when wake is not nil, sent
// wake(reason) so that it ends what its failed turn left.
//
// protoactor keeps one guardian per strategy value: hold the result in a
// package variable and pass that one to every Props, or each spawn gets a
// guardian process of its own.
func ResumeOnPanic(msg string, wake func(reason any) any) actor.SupervisorStrategy {
	return &resumeStrategy{msg: msg, wake: wake}
}

type resumeStrategy struct {
	msg  string
	wake func(reason any) any
}

func (s *resumeStrategy) HandleFailure(system *actor.ActorSystem, sup actor.Supervisor, child *actor.PID,
	rs *actor.RestartStatistics, reason, message any) {
	rs.Fail()
	system.Logger().Error(s.msg, "actor", child.Id, "reason", reason,
		"message", fmt.Sprintf("%T", message), "failures", rs.FailureCount(), "stack", string(debug.Stack()))
	sup.ResumeChildren(child)
	if s.wake != nil {
		system.Root.Send(child, s.wake(reason))
	}
}
