package testkit

import (
	"io"
	"net"
	"sync"
	"testing"

	"github.com/stretchr/testify/require"
)

// Link is a loopback TCP proxy to a server (NATS): cutting it is an outage
// of the links through it alone, while clients connected to the server
// directly see everything once it is back.
type Link struct {
	t      *testing.T
	Addr   string // where clients connect through the link
	target string

	mu    sync.Mutex
	ln    net.Listener
	conns []net.Conn
}

// NewLink proxies a fresh loopback port to target until the test ends.
func NewLink(t *testing.T, target string) *Link {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	l := &Link{t: t, Addr: ln.Addr().String(), target: target, ln: ln}
	go l.serve(ln)
	t.Cleanup(l.Cut)
	return l
}

func (l *Link) serve(ln net.Listener) {
	for {
		c, err := ln.Accept()
		if err != nil {
			return // cut
		}
		s, err := net.Dial("tcp", l.target)
		if err != nil {
			_ = c.Close()
			continue
		}
		l.mu.Lock()
		l.conns = append(l.conns, c, s)
		l.mu.Unlock()
		pipe := func(dst, src net.Conn) {
			_, _ = io.Copy(dst, src)
			_ = dst.Close()
			_ = src.Close()
		}
		go pipe(c, s)
		go pipe(s, c)
	}
}

// Cut closes the listener and every connection: a client sees its
// connection drop and every reconnect refused.
func (l *Link) Cut() {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.ln != nil {
		_ = l.ln.Close()
		l.ln = nil
	}
	for _, c := range l.conns {
		_ = c.Close()
	}
	l.conns = nil
}

// Restore listens again on the same address.
func (l *Link) Restore() {
	l.t.Helper()
	ln, err := net.Listen("tcp", l.Addr)
	require.NoError(l.t, err, "listen again on %s", l.Addr)
	l.mu.Lock()
	l.ln = ln
	l.mu.Unlock()
	go l.serve(ln)
}
