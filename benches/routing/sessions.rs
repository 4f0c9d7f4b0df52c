//! The prefix-locality workload of the `routing_prefix` bench: multi-turn sessions, shared
//! system prompts and one-off prompts, with token ids synthesized from the seed so that
//! prefixes match exactly where they should (the parameters and their sources are in the
//! bench's module docs).
//!
//! Every request belongs to a token stream: a session's conversation (system prompt, then
//! message, answer, message, answer, ...) or a one-off prompt's. Turn k's prompt is the
//! stream up to its k-th message; its output the answer after it. So the prompt of turn
//! k + 1 extends the prompt and output of turn k, and one stream of block hashes serves
//! every turn ([`Blocks`]).

use std::sync::Arc;

use lease_router::block_hashes;

use crate::common::Rng;
use crate::model::{lognormal, uniform, Blocks, Request};

/// The workload's parameters (see the bench's module docs for where each comes from).
#[derive(Clone, Copy, Debug)]
pub struct Workload {
    /// Tokens of each shared system prompt.
    pub system_prompts: [u32; 4],
    /// Share of sessions (and of one-off prompts) opening with each shared system prompt.
    pub system_share: f64,
    /// Share of the requests that are one-off prompts (the rest are session turns).
    pub one_off_share: f64,
    /// A one-off prompt's own tokens (after any system prompt): lognormal.
    pub one_off_median: f64,
    pub one_off_sigma: f64,
    /// A session's user message: lognormal.
    pub message_median: f64,
    pub message_sigma: f64,
    pub message_max: u32,
    /// Output tokens: lognormal.
    pub output_median: f64,
    pub output_sigma: f64,
    pub output_max: u32,
    /// Turns of a session: geometric with this mean (before the context cap).
    pub mean_turns: f64,
    /// Between two turns' arrivals: this minimum plus an exponential of mean `think_mean`.
    pub think_min: f64,
    pub think_mean: f64,
    /// The model's context: a session ends before a turn whose prompt and output would
    /// exceed it; a one-off prompt is cut to fit.
    pub context: u32,
    /// Sessions start this long before time 0, so that the mix of sessions under way is
    /// stationary from the start (their turns before 0 are not sent).
    pub lead: f64,
}

pub const WORKLOAD: Workload = Workload {
    system_prompts: [2048, 2560, 3072, 4096],
    system_share: 0.15,
    one_off_share: 0.3,
    one_off_median: 1020.0,
    one_off_sigma: 1.0,
    message_median: 256.0,
    message_sigma: 1.0,
    message_max: 4096,
    output_median: 129.0,
    output_sigma: 1.0,
    output_max: 2048,
    mean_turns: 4.0,
    think_min: 5.0,
    think_mean: 10.0,
    context: 16_384,
    lead: 120.0,
};

/// One request of the workload.
#[derive(Clone, Debug)]
pub struct Arrival {
    /// Sizes and arrival (`cached` is 0: what is cached depends on the worker).
    pub request: Request,
    pub blocks: Blocks,
    /// The session it is a turn of, and which turn (from 0); `None`: a one-off prompt.
    pub session: Option<(u64, u32)>,
    /// Prompt tokens an earlier request holds in full blocks (the previous turn's prompt and
    /// output, or the shared system prompt), at most `prompt - 1`: what a cache that never
    /// evicted, on the right worker, would serve.
    pub reusable: u32,
}

/// Vocabulary size of the synthesized token ids (Llama 3's).
const VOCAB: u64 = 128_256;

fn tokens(rng: &mut Rng, n: u32, out: &mut Vec<u32>) {
    out.extend((0..n).map(|_| (rng.next_u64() % VOCAB) as u32));
}

fn exponential(rng: &mut Rng, mean: f64) -> f64 {
    -(1.0 - uniform(rng)).ln() * mean
}

/// The seed of stream `kind`/`id`: the same for every load and setting.
fn stream_seed(seed: u64, kind: u64, id: u64) -> u64 {
    Rng::new(
        seed ^ kind.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ id.wrapping_mul(0xD1B5_4A32_D192_ED03),
    )
    .next_u64()
}

/// The token ids of the shared system prompts.
fn system_prompts(seed: u64, w: &Workload) -> Vec<Vec<u32>> {
    w.system_prompts
        .iter()
        .enumerate()
        .map(|(j, &n)| {
            let mut rng = Rng::new(stream_seed(seed, 1, j as u64));
            let mut out = Vec::with_capacity(n as usize);
            tokens(&mut rng, n, &mut out);
            out
        })
        .collect()
}

/// Which shared system prompt a stream opens with, if any.
fn system_prompt(rng: &mut Rng, w: &Workload) -> Option<usize> {
    let u = uniform(rng);
    let i = (u / w.system_share) as usize;
    (i < w.system_prompts.len()).then_some(i)
}

/// The full blocks of a prefix of `before` tokens, in tokens, at most `prompt - 1`.
fn reusable(before: u32, prompt: u32, block_size: usize) -> u32 {
    (before / block_size as u32 * block_size as u32).min(prompt - 1)
}

/// Requests of `w` arriving at `rate` per second on average until `until`, in arrival
/// order: one-off prompts a Poisson stream of `rate * one_off_share`, sessions starting as
/// a Poisson stream of `rate * (1 - one_off_share) / mean_turns` from `-lead` on.
pub fn arrivals(seed: u64, rate: f64, until: f64, w: &Workload, block_size: usize) -> Vec<Arrival> {
    let systems = system_prompts(seed, w);
    let mut out = Vec::new();
    let mut stream = Vec::new();

    // One-off prompts.
    let mut gaps = Rng::new(stream_seed(seed, 2, 0));
    let (mut t, mut id) = (0.0, 0u64);
    loop {
        t += exponential(&mut gaps, 1.0 / (rate * w.one_off_share));
        if t >= until {
            break;
        }
        let mut rng = Rng::new(stream_seed(seed, 3, id));
        stream.clear();
        if let Some(j) = system_prompt(&mut rng, w) {
            stream.extend_from_slice(&systems[j]);
        }
        let system = stream.len() as u32;
        let output = lognormal(&mut rng, w.output_median, w.output_sigma, w.output_max);
        let room = w
            .context
            .saturating_sub(output + stream.len() as u32)
            .max(1);
        let own = lognormal(&mut rng, w.one_off_median, w.one_off_sigma, room);
        tokens(&mut rng, own, &mut stream);
        let prompt = stream.len() as u32;
        tokens(&mut rng, output, &mut stream);
        let hashes: Arc<[u64]> = block_hashes(&stream, block_size).into();
        out.push(Arrival {
            request: Request {
                arrival: t,
                prompt,
                cached: 0,
                output,
            },
            blocks: Blocks {
                prompt: prompt as usize / block_size,
                sequence: hashes.len(),
                stream: hashes,
            },
            session: None,
            reusable: reusable(system, prompt, block_size),
        });
        id += 1;
    }

    // Sessions.
    let session_rate = rate * (1.0 - w.one_off_share) / w.mean_turns;
    let mut gaps = Rng::new(stream_seed(seed, 4, 0));
    let (mut start, mut session) = (-w.lead, 0u64);
    let mut turns: Vec<(f64, u32, u32)> = Vec::new();
    loop {
        start += exponential(&mut gaps, 1.0 / session_rate);
        if start >= until {
            break;
        }
        let mut rng = Rng::new(stream_seed(seed, 5, session));
        stream.clear();
        if let Some(j) = system_prompt(&mut rng, w) {
            stream.extend_from_slice(&systems[j]);
        }
        let system = stream.len() as u32;
        turns.clear();
        let mut at = start;
        loop {
            let message = lognormal(&mut rng, w.message_median, w.message_sigma, w.message_max);
            let output = lognormal(&mut rng, w.output_median, w.output_sigma, w.output_max);
            if stream.len() as u32 + message + output > w.context {
                break;
            }
            tokens(&mut rng, message, &mut stream);
            let prompt = stream.len() as u32;
            tokens(&mut rng, output, &mut stream);
            turns.push((at, prompt, output));
            // Geometric: another turn with probability 1 - 1 / mean.
            if uniform(&mut rng) < 1.0 / w.mean_turns {
                break;
            }
            at += w.think_min + exponential(&mut rng, w.think_mean);
        }
        let hashes: Arc<[u64]> = block_hashes(&stream, block_size).into();
        for (turn, &(at, prompt, output)) in turns.iter().enumerate() {
            if at < 0.0 || at >= until {
                continue;
            }
            let before = match turn {
                0 => system,
                _ => turns[turn - 1].1 + turns[turn - 1].2,
            };
            out.push(Arrival {
                request: Request {
                    arrival: at,
                    prompt,
                    cached: 0,
                    output,
                },
                blocks: Blocks {
                    stream: hashes.clone(),
                    prompt: prompt as usize / block_size,
                    sequence: (prompt + output) as usize / block_size,
                },
                session: Some((session, turn as u32)),
                reusable: reusable(before, prompt, block_size),
            });
        }
        session += 1;
    }
    out.sort_by(|a, b| a.request.arrival.total_cmp(&b.request.arrival));
    out
}

/// Completed requests per second of one worker kept saturated with a locality-perfect
/// share of `w` generated at `rate`: every turn of one session in eight, one one-off prompt
/// in eight, all queued at once in arrival order (so each session's turns reach the worker
/// that holds its history, and the shared system prompts stay cached there).
pub fn saturated_throughput(
    engine: crate::model::Engine,
    seed: u64,
    rate: f64,
    w: &Workload,
    workers: usize,
    cache_blocks: usize,
    block_size: usize,
) -> f64 {
    use crate::model::{Happened, Worker};
    const FROM: usize = 1000;
    const TO: usize = 5000;
    let until = (TO as f64 * 1.3 * workers as f64) / rate;
    let all = arrivals(seed ^ 0x5A7, rate, until, w, block_size);
    let mut worker = Worker::with_prefix_cache(engine, cache_blocks, block_size as u32);
    let mut one_offs = 0usize;
    let mut queued = 0;
    for (i, a) in all.into_iter().enumerate() {
        let mine = match a.session {
            Some((s, _)) => s.is_multiple_of(workers as u64),
            None => {
                one_offs += 1;
                one_offs.is_multiple_of(workers)
            }
        };
        if mine {
            worker.arrive_with_blocks(0.0, i, a.request, a.blocks);
            queued += 1;
        }
    }
    assert!(queued > TO, "{queued} requests queued, fewer than {TO}");
    let mut out = Vec::new();
    let (mut done, mut from) = (0usize, 0.0);
    while let Some(end) = worker.step_end {
        worker.end_step(false, &mut out);
        worker.joined.clear();
        for h in out.drain(..) {
            if let Happened::Completed(_) = h {
                done += 1;
                if done == FROM {
                    from = end;
                }
                if done == TO {
                    return (TO - FROM) as f64 / (end - from);
                }
            }
        }
    }
    unreachable!("the queue holds more than {TO} requests")
}
