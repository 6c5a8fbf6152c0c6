package testserver

import (
	"bytes"
	"context"
	"io"
	"net"
	"net/http"
	"testing"
	"time"
)

func TestPatternOffsets(t *testing.T) {
	whole := make([]byte, 1000)
	FillPattern(whole, 0)
	// Any window filled at its offset equals the same window of the whole.
	for _, w := range [][2]int{{0, 1}, {3, 17}, {8, 16}, {13, 999}, {999, 1000}} {
		part := make([]byte, w[1]-w[0])
		FillPattern(part, int64(w[0]))
		if !bytes.Equal(part, whole[w[0]:w[1]]) {
			t.Errorf("window %v differs", w)
		}
	}
	streamed, _ := io.ReadAll(Pattern(1000))
	if !bytes.Equal(streamed, whole) {
		t.Errorf("Pattern reader differs from FillPattern")
	}
	// No short period: the first 8-byte blocks are all different.
	seen := map[string]bool{}
	for i := 0; i+8 <= len(whole); i += 8 {
		seen[string(whole[i:i+8])] = true
	}
	if len(seen) != len(whole)/8 {
		t.Errorf("only %d distinct blocks of %d", len(seen), len(whole)/8)
	}
}

func TestVerifyPattern(t *testing.T) {
	good, _ := io.ReadAll(Pattern(200000))
	if n, m, err := VerifyPattern(bytes.NewReader(good)); n != 200000 || m != -1 || err != nil {
		t.Errorf("good stream: %d, %d, %v", n, m, err)
	}
	bad := bytes.Clone(good)
	bad[123456] ^= 1
	if n, m, err := VerifyPattern(bytes.NewReader(bad)); n != 200000 || m != 123456 || err != nil {
		t.Errorf("corrupted byte: %d, mismatch %d, %v; want 123456", n, m, err)
	}
	// A lost byte shows where it was lost.
	lost := append(bytes.Clone(good[:70000]), good[70001:]...)
	if _, m, _ := VerifyPattern(bytes.NewReader(lost)); m != 70000 {
		t.Errorf("lost byte: mismatch %d, want 70000", m)
	}
}

func TestServer(t *testing.T) {
	s, err := Listen(Config{Name: "backend-7", HTTPAddr: "127.0.0.1:0", UDPAddr: "127.0.0.1:0", TCPAddr: "127.0.0.1:0"})
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()

	resp, err := http.Get("http://" + s.HTTPAddr().String() + "/")
	if err != nil {
		t.Fatal(err)
	}
	body, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if string(body) != "backend-7" || resp.Header.Get("X-Backend") != "backend-7" {
		t.Errorf("GET / = %q, X-Backend %q", body, resp.Header.Get("X-Backend"))
	}
	resp, err = http.Get("http://" + s.HTTPAddr().String() + "/bytes?n=12345")
	if err != nil {
		t.Fatal(err)
	}
	n, m, err := VerifyPattern(resp.Body)
	resp.Body.Close()
	if n != 12345 || m != -1 || err != nil {
		t.Errorf("GET /bytes: %d, %d, %v", n, m, err)
	}

	u, err := net.Dial("udp", s.UDPAddr().String())
	if err != nil {
		t.Fatal(err)
	}
	name, err := Echo(u, "ping 1", time.Second)
	u.Close()
	if name != "backend-7" || err != nil {
		t.Errorf("Echo = %q, %v", name, err)
	}

	const size = 5 << 20
	c, err := net.Dial("tcp", s.StreamAddr().String())
	if err != nil {
		t.Fatal(err)
	}
	if got, m, err := Fetch(ctx, c, size); got != size || m != -1 || err != nil {
		t.Errorf("Fetch: %d, %d, %v", got, m, err)
	}
	c, err = net.Dial("tcp", s.StreamAddr().String())
	if err != nil {
		t.Fatal(err)
	}
	if got, m, err := Push(ctx, c, size); got != size || m != -1 || err != nil {
		t.Errorf("Push: %d, %d, %v", got, m, err)
	}
	// The server reports corruption it receives.
	c, err = net.Dial("tcp", s.StreamAddr().String())
	if err != nil {
		t.Fatal(err)
	}
	payload, _ := io.ReadAll(Pattern(1000))
	payload[500] ^= 0xff
	io.WriteString(c, "RECV\n")
	c.Write(payload)
	c.(*net.TCPConn).CloseWrite()
	reply, _ := io.ReadAll(c)
	c.Close()
	if string(reply) != "1000 500\n" {
		t.Errorf("corrupted push: reply %q, want \"1000 500\\n\"", reply)
	}
}

func TestDelayedEcho(t *testing.T) {
	s, err := Listen(Config{Name: "late", UDPAddr: "127.0.0.1:0"})
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	u, err := net.Dial("udp", s.UDPAddr().String())
	if err != nil {
		t.Fatal(err)
	}
	defer u.Close()
	start := time.Now()
	name, err := EchoDelayed(u, 300*time.Millisecond, "x y", 5*time.Second)
	if err != nil || name != "late" {
		t.Fatalf("EchoDelayed = %q, %v", name, err)
	}
	if took := time.Since(start); took < 300*time.Millisecond {
		t.Errorf("delayed reply came after %v, want at least 300ms", took)
	}
	// A plain datagram sent while a delayed one waits is answered first, from
	// the same socket.
	if _, err := io.WriteString(u, "delay 400 slow"); err != nil {
		t.Fatal(err)
	}
	if name, err := Echo(u, "fast", time.Second); err != nil || name != "late" {
		t.Fatalf("Echo while a delayed reply waits = %q, %v", name, err)
	}
	buf := make([]byte, 100)
	u.SetReadDeadline(time.Now().Add(3 * time.Second))
	n, err := u.Read(buf)
	if err != nil || string(buf[:n]) != "late delay 400 slow" {
		t.Errorf("delayed reply = %q, %v", buf[:n], err)
	}
	// Not a delay command: echoed at once.
	for _, p := range []string{"delay", "delay x y", "delay 99999999999 z", "delay -1 z", "delay 5"} {
		if name, err := Echo(u, p, time.Second); err != nil || name != "late" {
			t.Errorf("Echo(%q) = %q, %v", p, name, err)
		}
	}
	// Close drops what still waits, without waiting for it.
	io.WriteString(u, "delay 60000 never")
	time.Sleep(50 * time.Millisecond)
	start = time.Now()
	s.Close()
	if took := time.Since(start); took > 2*time.Second {
		t.Errorf("Close took %v with a delayed reply pending", took)
	}
}

func TestTicks(t *testing.T) {
	s, err := Listen(Config{Name: "ticker", TCPAddr: "127.0.0.1:0"})
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	c, err := net.Dial("tcp", s.StreamAddr().String())
	if err != nil {
		t.Fatal(err)
	}
	start := time.Now()
	ticks, err := StartTicks(c, 50*time.Millisecond)
	if err != nil {
		t.Fatal(err)
	}
	for want := int64(1); want <= 3; want++ {
		seq, name, err := ticks.Next(5 * time.Second)
		if err != nil || seq != want || name != "ticker" {
			t.Fatalf("tick %d = %d %q, %v", want, seq, name, err)
		}
	}
	if took := time.Since(start); took < 150*time.Millisecond {
		t.Errorf("3 ticks at 50ms came in %v", took)
	}
	ticks.Close()

	// A bad interval is refused.
	c, err = net.Dial("tcp", s.StreamAddr().String())
	if err != nil {
		t.Fatal(err)
	}
	io.WriteString(c, "TICK 0\n")
	reply, _ := io.ReadAll(c)
	c.Close()
	if !bytes.HasPrefix(reply, []byte("ERR")) {
		t.Errorf("TICK 0: %q, want an error", reply)
	}

	// Close cuts a ticking connection.
	c, err = net.Dial("tcp", s.StreamAddr().String())
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	ticks, _ = StartTicks(c, time.Second)
	time.Sleep(50 * time.Millisecond)
	start = time.Now()
	s.Close()
	if took := time.Since(start); took > 2*time.Second {
		t.Errorf("Close took %v with a ticking connection", took)
	}
	if _, _, err := ticks.Next(2 * time.Second); err == nil {
		t.Errorf("tick after Close")
	}
}
