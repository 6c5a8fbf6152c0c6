package main

import (
	"bytes"
	"crypto/tls"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/xdproxy/xdproxy/internal/testbed"
)

// Clients on the node (pods, host processes) must run in the node's cgroup
// for the socket programs to translate their connections, so they are
// this test binary run again as a client, started in a pod's namespace and
// the NodeBed's cgroup. They print one line per result.

// clientEnv marks a run of this test binary as a client (runClient).
const clientEnv = "XDPROXY_E2E_CLIENT"

// runClient is the client's main:
//
//	http URL N        N GETs, each on a new connection: prints each body
//	https URL N       the same over TLS, without verifying the server
//	udp ADDR N        N queries, each from a new socket: prints "ok K"
//	udprtt ADDR N     N echoes on one socket: prints "rtt MEDIAN_US"
func runClient(args []string) int {
	fail := func(format string, a ...any) int {
		fmt.Printf("error "+format+"\n", a...)
		return 1
	}
	if len(args) < 3 {
		return fail("usage: http|udp|udprtt TARGET N")
	}
	n, err := strconv.Atoi(args[2])
	if err != nil {
		return fail("count %q", args[2])
	}
	switch args[0] {
	case "http", "https":
		tr := &http.Transport{DisableKeepAlives: true}
		if args[0] == "https" {
			tr.TLSClientConfig = &tls.Config{InsecureSkipVerify: true}
		}
		c := &http.Client{Timeout: 5 * time.Second, Transport: tr}
		for i := range n {
			resp, err := c.Get(args[1])
			if err != nil {
				return fail("request %d: %v", i, err)
			}
			b, _ := io.ReadAll(resp.Body)
			resp.Body.Close()
			fmt.Println(strings.TrimSpace(string(b)))
		}
	case "udp":
		ok := 0
		for i := range n {
			c, err := net.Dial("udp", args[1])
			if err != nil {
				return fail("query %d: %v", i, err)
			}
			msg := fmt.Sprintf("q%d", i)
			_ = c.SetDeadline(time.Now().Add(2 * time.Second))
			buf := make([]byte, 256)
			if _, err := c.Write([]byte(msg)); err == nil {
				if m, err := c.Read(buf); err == nil && strings.HasSuffix(string(buf[:m]), " "+msg) {
					ok++
				}
			}
			c.Close()
		}
		fmt.Println("ok", ok)
	case "udprtt":
		c, err := net.Dial("udp", args[1])
		if err != nil {
			return fail("%v", err)
		}
		defer c.Close()
		var rtts []time.Duration
		buf := make([]byte, 256)
		for i := range n {
			_ = c.SetDeadline(time.Now().Add(2 * time.Second))
			start := time.Now()
			if _, err := c.Write([]byte("p" + strconv.Itoa(i))); err != nil {
				return fail("%v", err)
			}
			if _, err := c.Read(buf); err != nil {
				return fail("echo %d: %v", i, err)
			}
			rtts = append(rtts, time.Since(start))
		}
		slices.Sort(rtts)
		fmt.Println("rtt", rtts[len(rtts)/2].Microseconds())
	default:
		return fail("unknown mode %q", args[0])
	}
	return 0
}

// onNode runs a client in ns; inCgroup puts it in the NodeBed's cgroup (a
// pod or host process of the node), otherwise it is outside the node's
// cgroup (another machine, or a process the socket programs must not see).
func onNode(nb *testbed.NodeBed, ns string, inCgroup bool, args ...string) ([]string, error) {
	cmd := exec.Command("/proc/self/exe", args...)
	cmd.Env = append(os.Environ(), clientEnv+"=1")
	var out bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &out
	start := nb.Start
	if inCgroup {
		start = nb.StartInCgroup
	}
	if err := start(ns, cmd); err != nil {
		return nil, err
	}
	err := cmd.Wait()
	lines := strings.Split(strings.TrimSpace(out.String()), "\n")
	if err != nil {
		return lines, fmt.Errorf("%v: %s", err, out.String())
	}
	return lines, nil
}
