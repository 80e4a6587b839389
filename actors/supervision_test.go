package actors

import (
	"log/slog"
	"strings"
	"testing"
	"time"

	"github.com/asynkron/protoactor-go/actor"
	"github.com/stretchr/testify/require"

	"github.com/kvactors/kvactors/internal/testkit"
)

type boom struct{}

type woken struct{ reason any }

// counter panics on boom after counting it, and reports each count and
// each wake-up: a restart would start it again from zero.
type counter struct {
	n   int
	out chan any
}

func (a *counter) Receive(c actor.Context) {
	switch m := c.Message().(type) {
	case boom:
		a.n++
		a.out <- a.n
		panic("boom")
	case *woken:
		a.out <- m
	case *actor.Restarting:
		a.out <- "restarted"
	}
}

// A guardian from ResumeOnPanic resumes a panicking actor with its fields
// and sends it wake(reason); the same strategy value serves every spawn.
func TestResumeOnPanicKeepsTheStateAndWakesTheActor(t *testing.T) {
	sys, logs := quietSystem(t)
	guardian := ResumeOnPanic("test actor failed; resumed", func(r any) any { return &woken{reason: r} })
	for range 2 {
		out := make(chan any, 8)
		pid := sys.Root.Spawn(actor.PropsFromProducer(func() actor.Actor { return &counter{out: out} },
			actor.WithGuardian(guardian)))
		for want := 1; want <= 2; want++ {
			sys.Root.Send(pid, boom{})
			require.Equal(t, want, testkit.Recv(t, out, 5*time.Second, "the count"), "a restart would count from 1 again")
			w, ok := testkit.Recv(t, out, 5*time.Second, "the wake-up").(*woken)
			require.True(t, ok, "the wake-up comes after the count")
			require.Equal(t, "boom", w.reason)
		}
		sys.Root.Stop(pid)
	}
	require.Equal(t, 4, strings.Count(logs.String(), "test actor failed; resumed"), "each failure logged")
	require.Contains(t, logs.String(), "supervision_test.go", "with the panicking goroutine's stack")
}

// quietSystem is an actor system whose logs go to a buffer the test reads.
func quietSystem(t *testing.T) (*actor.ActorSystem, *testkit.SyncBuffer) {
	logs := &testkit.SyncBuffer{}
	sys := actor.NewActorSystem(actor.WithLoggerFactory(func(*actor.ActorSystem) *slog.Logger {
		return slog.New(slog.NewTextHandler(logs, nil))
	}))
	t.Cleanup(sys.Shutdown)
	return sys, logs
}

// Without wake, the actor is only resumed.
func TestResumeOnPanicWithoutWakeOnlyResumes(t *testing.T) {
	sys, _ := quietSystem(t)
	out := make(chan any, 8)
	pid := sys.Root.Spawn(actor.PropsFromProducer(func() actor.Actor { return &counter{out: out} },
		actor.WithGuardian(ResumeOnPanic("test actor failed; resumed", nil))))
	sys.Root.Send(pid, boom{})
	require.Equal(t, 1, testkit.Recv(t, out, 5*time.Second, "the first count"))
	sys.Root.Send(pid, boom{})
	require.Equal(t, 2, testkit.Recv(t, out, 5*time.Second, "the second count"), "resumed, not restarted")
}
