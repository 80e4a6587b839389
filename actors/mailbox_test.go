package actors_test

import (
	"bytes"
	"log/slog"
	"runtime"
	"strconv"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/asynkron/protoactor-go/actor"
	"github.com/stretchr/testify/require"

	"github.com/kvactors/kvactors/actors"
)

// recorder is an actor that checks it is never run by two goroutines at
// once and records the user messages it handled.
type recorder struct {
	mu      sync.Mutex
	got     []int
	running atomic.Int32
	overlap atomic.Int32
	depth   int
	nested  bool
	self    func(c actor.Context, n int)
}

func (r *recorder) Receive(c actor.Context) {
	if r.running.Add(1) > 1 {
		r.overlap.Add(1)
	}
	defer r.running.Add(-1)
	n, ok := c.Message().(int)
	if !ok {
		return
	}
	if r.depth++; r.depth > 1 {
		r.nested = true
	}
	defer func() { r.depth-- }()
	if n < 0 {
		panic("boom")
	}
	r.mu.Lock()
	r.got = append(r.got, n)
	r.mu.Unlock()
	if r.self != nil {
		r.self(c, n)
	}
}

func (r *recorder) handled() []int {
	r.mu.Lock()
	defer r.mu.Unlock()
	return append([]int(nil), r.got...)
}

func spawnInline(t *testing.T, r *recorder) (*actor.ActorSystem, *actor.PID) {
	t.Helper()
	system := actor.NewActorSystem()
	t.Cleanup(system.Shutdown)
	pid := system.Root.Spawn(actor.PropsFromProducer(func() actor.Actor { return r },
		actor.WithMailbox(actors.InlineMailbox)))
	return system, pid
}

func TestInlineMailboxRunsOnThePostersGoroutineWhenIdle(t *testing.T) {
	r := &recorder{}
	system, pid := spawnInline(t, r)
	for i := range 100 {
		system.Root.Send(pid, i)
		// Handled before Send returned: the poster ran it.
		if got := r.handled(); len(got) != i+1 || got[i] != i {
			t.Fatalf("after send %d handled %v", i, got)
		}
	}
}

func TestInlineMailboxPostFromARunIsQueuedNotNested(t *testing.T) {
	r := &recorder{}
	r.self = func(c actor.Context, n int) {
		if n < 5 {
			c.Send(c.Self(), n+1)
			c.Send(c.Self(), 100+n)
		}
	}
	system, pid := spawnInline(t, r)
	system.Root.Send(pid, 0)
	want := []int{0, 1, 100, 2, 101, 3, 102, 4, 103, 5, 104}
	got := r.handled()
	if len(got) != len(want) {
		t.Fatalf("handled %v, want %v", got, want)
	}
	for i := range want {
		if got[i] != want[i] {
			t.Fatalf("handled %v, want %v", got, want)
		}
	}
	if r.nested {
		t.Fatal("a post from inside a run ran nested")
	}
}

func TestInlineMailboxConcurrentPostersOneRunnerInOrder(t *testing.T) {
	r := &recorder{}
	system, pid := spawnInline(t, r)
	const posters, each = 4, 2000
	var wg sync.WaitGroup
	for p := range posters {
		wg.Go(func() {
			for i := range each {
				system.Root.Send(pid, p*each+i)
			}
		})
	}
	wg.Wait()
	// Every post either ran its message or found a runner that will; the
	// last runner finished before its poster's Send returned.
	got := r.handled()
	if len(got) != posters*each {
		t.Fatalf("handled %d of %d", len(got), posters*each)
	}
	if n := r.overlap.Load(); n != 0 {
		t.Fatalf("%d runs overlapped", n)
	}
	last := make([]int, posters)
	for p := range last {
		last[p] = -1
	}
	for _, n := range got {
		p, i := n/each, n%each
		if i <= last[p] {
			t.Fatalf("poster %d: %d handled after %d", p, i, last[p])
		}
		last[p] = i
	}
}

// A panic is escalated to the parent's supervisor, which stops the actor
// (actors.StopOnPanic): nothing after the panic is handled, and the
// parent sees it terminate.
func TestInlineMailboxPanicEscalatesAndStops(t *testing.T) {
	system := actor.NewActorSystem()
	t.Cleanup(system.Shutdown)
	r := &recorder{}
	terminated := make(chan struct{})
	var child *actor.PID
	parent := system.Root.Spawn(actor.PropsFromFunc(func(c actor.Context) {
		switch m := c.Message().(type) {
		case string:
			child = c.Spawn(actor.PropsFromProducer(func() actor.Actor { return r },
				actor.WithMailbox(actors.InlineMailbox)))
			c.Respond(child)
		case *actor.Terminated:
			if m.Who.Equal(child) {
				close(terminated)
			}
		}
	}, actor.WithSupervisor(actors.StopOnPanic(slog.New(slog.DiscardHandler)))))
	res, err := system.Root.RequestFuture(parent, "spawn", 5*time.Second).Result()
	if err != nil {
		t.Fatal(err)
	}
	pid := res.(*actor.PID)
	system.Root.Send(pid, 1)
	system.Root.Send(pid, -1) // panics
	system.Root.Send(pid, 2)
	select {
	case <-terminated:
	case <-time.After(10 * time.Second):
		t.Fatal("the failed actor was not stopped")
	}
	system.Root.Send(pid, 3)
	if got := r.handled(); len(got) != 1 || got[0] != 1 {
		t.Fatalf("handled %v, want [1]", got)
	}
}

// InlineMailboxFor runs only the messages it accepts on the poster: others
// (and system messages) go to the dispatcher, so a poster that holds a
// lock the handler needs does not deadlock, and a batch posted while that
// runner works waits for it.
func TestInlineMailboxForRunsOthersOnTheDispatcher(t *testing.T) {
	system := actor.NewActorSystem()
	t.Cleanup(system.Shutdown)
	var mu sync.Mutex
	var got []string
	var ranOn uint64 // the goroutine that handled the last message
	release := make(chan struct{})
	blocked := make(chan struct{})
	handled := make(chan struct{}, 4)
	pid := system.Root.Spawn(actor.PropsFromFunc(func(c actor.Context) {
		s, ok := c.Message().(string)
		if !ok {
			return
		}
		mu.Lock()
		ranOn = goroutineID()
		mu.Unlock()
		if s == "held" {
			close(blocked)
			<-release
		}
		mu.Lock()
		got = append(got, s)
		mu.Unlock()
		handled <- struct{}{}
	}, actor.WithMailbox(actors.InlineMailboxFor(func(m any) bool { return m == "inline" }))))

	system.Root.Send(pid, "warm") // after Started, which ran on the dispatcher
	<-handled
	// Idle: handled before Send returns. The dispatcher's runner may not
	// have given the mailbox up yet when "warm" signals (it does so just
	// after): then "inline" queues behind it, and the next try finds the
	// actor idle.
	inline, me := false, goroutineID()
	for try := 0; try < 100 && !inline; try++ {
		system.Root.Send(pid, "inline")
		<-handled
		mu.Lock()
		inline = ranOn == me
		mu.Unlock()
	}
	require.True(t, inline, "an inline message posted to an idle actor runs on the poster")
	mu.Lock()
	got = got[:2] // "warm", "inline": one try stands for all in the order checked below
	mu.Unlock()
	system.Root.Send(pid, "held") // not inline: Send returns while it blocks
	select {
	case <-blocked:
	case <-time.After(10 * time.Second):
		t.Fatal("the dispatched message never ran")
	}
	system.Root.Send(pid, "inline") // a runner has the mailbox: queued
	close(release)
	for range 2 {
		select {
		case <-handled:
		case <-time.After(10 * time.Second):
			t.Fatal("queued message not handled")
		}
	}
	mu.Lock()
	defer mu.Unlock()
	if want := []string{"warm", "inline", "held", "inline"}; len(got) != 4 || got[2] != want[2] || got[3] != want[3] {
		t.Fatalf("handled %v, want %v", got, want)
	}
}

// goroutineID is the running goroutine's id, from its stack header
// ("goroutine 42 [running]:"): tests only, to tell who ran a handler.
func goroutineID() uint64 {
	var buf [64]byte
	b := buf[:runtime.Stack(buf[:], false)]
	b = bytes.TrimPrefix(b, []byte("goroutine "))
	id, _ := strconv.ParseUint(string(b[:bytes.IndexByte(b, ' ')]), 10, 64)
	return id
}
