package testkit

import (
	"io"
	"net"
	"sync"
	"sync/atomic"
	"testing"

	"github.com/stretchr/testify/require"
)

// Link is a loopback TCP proxy to a server (NATS): cutting it is an outage
// of the links through it alone, while clients connected to the server
// directly see everything once it is back.
//
// It keeps its port for the whole test, cut or not: closing the listener at
// a cut let another test's listener or an outgoing connection take the port
// before Restore listened on it again ("address already in use", seen in
// CI). While cut, a connection is accepted and closed at once, which a NATS
// client or route takes as a failed connect, as it would a refused one.
type Link struct {
	Addr   string // where clients connect through the link
	target string
	ln     net.Listener

	mu     sync.Mutex
	cut    bool
	conns  []net.Conn
	frozen atomic.Bool
}

// NewLink proxies a fresh loopback port to target until the test ends.
func NewLink(t *testing.T, target string) *Link {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	l := &Link{Addr: ln.Addr().String(), target: target, ln: ln}
	go l.serve()
	t.Cleanup(func() {
		_ = l.ln.Close()
		l.Cut()
	})
	return l
}

func (l *Link) serve() {
	for {
		c, err := l.ln.Accept()
		if err != nil {
			return // the test ended
		}
		l.mu.Lock()
		cut := l.cut
		l.mu.Unlock()
		if cut {
			_ = c.Close()
			continue
		}
		s, err := net.Dial("tcp", l.target)
		if err != nil {
			_ = c.Close()
			continue
		}
		l.mu.Lock()
		if l.cut { // cut while dialing: this pair is not tracked, so close it here
			l.mu.Unlock()
			_ = c.Close()
			_ = s.Close()
			continue
		}
		l.conns = append(l.conns, c, s)
		l.mu.Unlock()
		pipe := func(dst, src net.Conn) {
			_, _ = io.Copy(dst, l.unlessFrozen(src))
			_ = dst.Close()
			_ = src.Close()
		}
		go pipe(c, s)
		go pipe(s, c)
	}
}

// Cut closes every connection through the link and turns new ones away: a
// client sees its connection drop and every reconnect fail.
func (l *Link) Cut() {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.cut = true
	for _, c := range l.conns {
		_ = c.Close()
	}
	l.conns = nil
}

// Restore lets connections through again, on the same address, and ends
// a Freeze.
func (l *Link) Restore() {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.cut = false
	l.frozen.Store(false)
}

// Freeze drops whatever is sent through the link, either way, and closes
// nothing: a link gone silent (a partition that drops packets), which a
// client notices only when its pings go unanswered. What is sent while
// frozen is lost, as in such a partition.
func (l *Link) Freeze() { l.frozen.Store(true) }

// unlessFrozen reads src, dropping what it reads while the link is frozen.
func (l *Link) unlessFrozen(src io.Reader) io.Reader {
	return readerFunc(func(p []byte) (int, error) {
		for {
			k, err := src.Read(p)
			if err != nil || !l.frozen.Load() {
				return k, err
			}
		}
	})
}

type readerFunc func([]byte) (int, error)

func (f readerFunc) Read(p []byte) (int, error) { return f(p) }
