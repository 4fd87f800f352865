// Package transforms rewrites requests on their way out of a sandbox and
// scrubs the responses on their way back in.
//
// It provides the request-transformation rules of the AI SDK harness (a
// match on host, path, method, query string and headers, and a transform
// that overwrites headers), the swap of placeholders for secrets, and the
// scrubbing of those secrets from responses (secret → placeholder; a run of
// 12 or more of a secret's bytes → a mask), including gzip- and
// zstd-encoded bodies, streaming and without holding back more than a
// secret's length needs; and the credential guard ([Guard]), which
// refuses what the scrub would mask (a secret, or a run of 12 or more of
// its bytes) in anything bound for a sandbox (values, streams, tars)
// before any byte of it goes in.
//
// A secret is a [Secret]: it prints, logs and marshals as "[REDACTED]" and
// nothing outside this package can read it back. The only places its value
// goes are the outbound request headers built by [RuleSet.Apply] and the
// comparisons made by the scrubbers.
//
// The proxy drives all of it through a [Chain], which holds the one order
// that keeps secrets safe (user modules, then the swap; on the way back the
// scrub, then the modules' response pass):
//
//	chain := transforms.Chain{Modules: modules, Rules: set} // modules: a wasm.Chain
//	x, err := chain.Request(ctx, out, info)  // out is the outbound *http.Request
//	defer x.Close()
//	if a := x.Answer(); a != nil { /* a module answered: send that */ }
//	resp, err := send(out)
//	if err := x.Response(ctx, resp); err != nil { /* close body, answer 502 */ }
//	audit := x.Audit()                       // after Close: rules, module, notes
//
// See README.md for the rule format and the scrubbing semantics.
package transforms
