//! The engine (`stoke_engine::Engine`) on the CPU, with a random-weight model: requests that
//! join and leave a running batch get the tokens they get alone (greedy and seeded sampling),
//! abort and preemption give their pages back and change no tokens, shared prompt prefixes
//! change no tokens, stop strings and stop tokens end requests where they should, log-
//! probabilities come with their tokens, and bad requests get typed errors.

use burn::tensor::DType;
use std::collections::HashMap;
use std::sync::Arc;
use stoke::FusedOps;
use stoke_engine::{Engine, EngineConfig, EngineError, Event, FinishReason, Params, RequestId};
use stoke_llama::load::load_gguf;
use stoke_llama::model::Llama;
use stoke_llama::run::TokenizerText;
use stoke_llama::synthetic::{PACKABLE, gguf, weights};

type B = burn_ndarray::NdArray<f32>;

fn loaded<Be: FusedOps>() -> stoke_llama::load::Loaded<Be> {
    let dir = std::env::temp_dir().join(format!("stoke-engine-test-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    static NEXT: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let path = dir.join(format!("packable-{n}.gguf"));
    std::fs::write(&path, gguf(&PACKABLE, &weights(&PACKABLE, true, 21))).unwrap();
    let mut l = load_gguf::<Be>(&path, &Default::default(), DType::F32, 256).unwrap();
    l.model = l.model.pinned();
    l
}

/// Pages of 16 positions (the smallest), so that prompts and outputs cross pages.
fn config(lanes: usize, pages: Option<usize>) -> EngineConfig {
    EngineConfig {
        max_running: lanes,
        context: 160,
        page_size: 16,
        kv_pages: Some(pages.unwrap_or(lanes * 10 + 1)),
        max_prefill_tokens: 48,
        ..Default::default()
    }
}

/// Prompts of different lengths (some longer than the prefill budget, so they take several
/// chunks), token ids of the byte tokenizer's letters.
fn prompts() -> Vec<Vec<u32>> {
    [9, 40, 3, 71, 18, 33]
        .iter()
        .enumerate()
        .map(|(i, &n)| (0..n).map(|j| 97 + ((j * 7 + i * 3) % 26) as u32).collect())
        .collect()
}

/// Each prompt's tokens and why it ended, by prompt index.
type Done = HashMap<usize, (Vec<u32>, FinishReason)>;

/// Steps `engine` until nothing is left, adding `arrivals[s]` (prompt index, params) before
/// step `s`; returns each prompt's tokens and finish reason, and every event in order.
fn drive<M: stoke_engine::EngineModel<B>>(
    engine: &mut Engine<B, M>,
    prompts: &[Vec<u32>],
    arrivals: &[Vec<(usize, Params)>],
) -> (Done, Vec<Event>) {
    let mut index: HashMap<RequestId, usize> = HashMap::new();
    let mut tokens: HashMap<usize, Vec<u32>> = HashMap::new();
    let mut done = HashMap::new();
    let mut all = Vec::new();
    let mut step = 0;
    while step < arrivals.len() || engine.has_work() {
        for (i, p) in arrivals.get(step).cloned().unwrap_or_default() {
            let id = engine.add(prompts[i].clone(), p).unwrap();
            index.insert(id, i);
        }
        for e in engine.step().unwrap() {
            match &e {
                Event::Token { id, token, .. } => tokens.entry(index[id]).or_default().push(*token),
                Event::Finished { id, reason, .. } => {
                    let i = index[id];
                    done.insert(i, (tokens.remove(&i).unwrap_or_default(), reason.clone()));
                }
            }
            all.push(e);
        }
        step += 1;
        assert!(step < 10_000, "the engine does not finish");
    }
    (done, all)
}

/// Each prompt alone on a fresh engine with one lane.
fn alone(m: &Llama<B>, prompts: &[Vec<u32>], params: &dyn Fn(usize) -> Params) -> Vec<Vec<u32>> {
    (0..prompts.len())
        .map(|i| {
            let mut e = Engine::new(m, config(1, None), None).unwrap();
            let (done, _) = drive(&mut e, prompts, &[vec![(i, params(i))]]);
            done[&i].0.clone()
        })
        .collect()
}

/// Arrivals at staggered steps: two at once, then one every few steps.
fn staggered(params: &dyn Fn(usize) -> Params) -> Vec<Vec<(usize, Params)>> {
    let mut a = vec![Vec::new(); 12];
    for (i, step) in [0, 0, 2, 5, 5, 11].into_iter().enumerate() {
        a[step].push((i, params(i)));
    }
    a
}

fn greedy(i: usize) -> Params {
    Params {
        ignore_eos: true,
        ..Params::greedy(8 + 3 * i)
    }
}

fn sampled(i: usize) -> Params {
    Params {
        temperature: 0.9,
        top_p: 0.95,
        top_k: 40,
        repetition_penalty: 1.1,
        seed: Some(1000 + i as u64),
        ..greedy(i)
    }
}

#[test]
fn staggered_requests_get_the_tokens_they_get_alone() {
    let l = loaded::<B>();
    let p = prompts();
    for params in [&greedy as &dyn Fn(usize) -> Params, &sampled] {
        let want = alone(&l.model, &p, params);
        // Three lanes for six requests: some wait for a lane; lanes are reused.
        let mut e = Engine::new(&l.model, config(3, None), None).unwrap();
        let (done, _) = drive(&mut e, &p, &staggered(params));
        for (i, w) in want.iter().enumerate() {
            assert_eq!(&done[&i].0, w, "request {i}");
            assert_eq!(done[&i].1, FinishReason::MaxTokens);
            assert_eq!(w.len(), params(i).max_tokens);
        }
        assert_eq!(e.stats().pages_used, 0, "every page back");
        assert_eq!(e.stats().running, 0);
    }
}

/// Requests that end on a token taken while the decode step warms up at a new row bucket (the
/// engine takes the tokens already queued first): one token only on a fresh engine, and short
/// requests whose arrivals open new buckets while others end. Each ends with its tokens, and
/// the ones still running go on.
#[test]
fn requests_ending_while_a_new_bucket_warms_up() {
    let l = loaded::<B>();
    let p = prompts();
    let one = |i| Params {
        max_tokens: 1,
        ..greedy(i)
    };
    let mut e = Engine::new(&l.model, config(4, None), None).unwrap();
    let (done, _) = drive(&mut e, &p, &[vec![(0, one(0))]]);
    assert_eq!(done[&0].0.len(), 1);
    assert_eq!(done[&0].1, FinishReason::MaxTokens);
    // Lanes 0..3 fill one by one while requests of 1 to 3 tokens end.
    let short = |i: usize| Params {
        max_tokens: 1 + i % 3,
        ..greedy(i)
    };
    let mut arrivals = vec![Vec::new(); 8];
    for (i, step) in [0, 1, 1, 2, 3, 5].into_iter().enumerate() {
        arrivals[step].push((i, short(i)));
    }
    let mut e = Engine::new(&l.model, config(4, None), None).unwrap();
    let (done, _) = drive(&mut e, &p, &arrivals);
    let want = alone(&l.model, &p, &short);
    for i in 0..p.len() {
        assert_eq!(done[&i].0, want[i], "request {i}");
        assert_eq!(done[&i].1, FinishReason::MaxTokens, "request {i}");
    }
}

#[test]
fn stoke_ndarray_engine_matches_ndarray() {
    // The same requests on Stoke's CPU kernels give the same greedy tokens.
    let l = loaded::<B>();
    let s = loaded::<stoke::Stoke<B>>();
    let p = prompts();
    let mut e = Engine::new(&l.model, config(3, None), None).unwrap();
    let (want, _) = drive(&mut e, &p, &staggered(&greedy));
    let mut e = Engine::new(&s.model, config(3, None), None).unwrap();
    let mut index = HashMap::new();
    let mut got: HashMap<usize, Vec<u32>> = HashMap::new();
    for (step, arrivals) in staggered(&greedy).into_iter().enumerate() {
        for (i, par) in arrivals {
            index.insert(e.add(p[i].clone(), par).unwrap(), i);
        }
        let _ = step;
        for ev in e.step().unwrap() {
            if let Event::Token { id, token, .. } = ev {
                got.entry(index[&id]).or_default().push(token);
            }
        }
    }
    while e.has_work() {
        for ev in e.step().unwrap() {
            if let Event::Token { id, token, .. } = ev {
                got.entry(index[&id]).or_default().push(token);
            }
        }
    }
    for (i, (w, _)) in &want {
        assert_eq!(&got[i], w, "request {i}");
    }
}

#[test]
fn preemption_recomputes_without_changing_tokens() {
    let l = loaded::<B>();
    let p = prompts();
    let long = |i: usize| Params {
        max_tokens: 45,
        ..greedy(i)
    };
    let long_sampled = |i: usize| Params {
        max_tokens: 45,
        ..sampled(i)
    };
    for params in [&long as &dyn Fn(usize) -> Params, &long_sampled] {
        let want = alone(&l.model, &p, params);
        // 6 lanes but 14 usable pages of 16: the requests need 30 at their longest.
        let mut e = Engine::new(&l.model, config(6, Some(15)), None).unwrap();
        let arrivals: Vec<Vec<(usize, Params)>> = vec![(0..6).map(|i| (i, params(i))).collect()];
        let (done, _) = drive(&mut e, &p, &arrivals);
        assert!(e.stats().preemptions > 0, "the pool was large enough");
        for (i, w) in want.iter().enumerate() {
            assert_eq!(&done[&i].0, w, "request {i}");
        }
        assert_eq!(e.stats().pages_used, 0);
    }
}

#[test]
fn shared_prefixes_give_the_tokens_of_cold_runs() {
    let l = loaded::<B>();
    // Three prompts with a common 40-token prefix (two full pages of 16), and one equal to the
    // first.
    let prefix: Vec<u32> = (0..40).map(|j| 97 + (j * 5 % 26) as u32).collect();
    let tails = [vec![98, 99, 100], vec![101; 20], vec![102, 103]];
    let mut p: Vec<Vec<u32>> = tails
        .iter()
        .map(|t| [prefix.clone(), t.clone()].concat())
        .collect();
    p.push(p[0].clone());
    let cold: Vec<Vec<u32>> = {
        let mut c = config(1, None);
        c.prefix_caching = false;
        (0..p.len())
            .map(|i| {
                let mut e = Engine::new(&l.model, c.clone(), None).unwrap();
                drive(&mut e, &p, &[vec![(i, greedy(i))]]).0[&i].0.clone()
            })
            .collect()
    };
    // The first alone, then the others while it still holds its pages, then the first again.
    let mut e = Engine::new(&l.model, config(3, None), None).unwrap();
    let mut arrivals = vec![Vec::new(); 8];
    arrivals[0].push((0, greedy(0)));
    arrivals[3] = vec![(1, greedy(1)), (2, greedy(2))];
    arrivals[7].push((3, greedy(3)));
    let (done, _) = drive(&mut e, &p, &arrivals);
    let st = e.stats();
    assert!(st.prefix_hits >= 2 * 3, "{st:?}");
    for (i, w) in cold.iter().enumerate() {
        assert_eq!(&done[&i].0, w, "request {i}");
    }
    assert_eq!(st.pages_used, 0);
    assert!(st.pages_cached >= 2, "the prefix pages stay cached, idle");
}

#[test]
fn abort_gives_the_pages_back_at_once() {
    let l = loaded::<B>();
    let p = prompts();
    let mut e = Engine::new(&l.model, config(3, None), None).unwrap();
    let ids: Vec<RequestId> = (0..3)
        .map(|i| e.add(p[i].clone(), Params::greedy(100)).unwrap())
        .collect();
    for _ in 0..4 {
        e.step().unwrap();
    }
    let before = e.stats().pages_used;
    assert!(e.abort(ids[1]).unwrap());
    assert!(!e.abort(ids[1]).unwrap(), "an aborted request is gone");
    assert!(e.stats().pages_used < before);
    let events = e.step().unwrap();
    assert!(events.iter().any(|ev| matches!(ev,
        Event::Finished { id, reason: FinishReason::Aborted, .. } if *id == ids[1])));
    // A waiting request can be aborted too; the others run on.
    let w = e.add(p[3].clone(), Params::greedy(5)).unwrap();
    assert!(e.abort(w).unwrap());
    e.abort(ids[0]).unwrap();
    e.abort(ids[2]).unwrap();
    while e.has_work() {
        e.step().unwrap();
    }
    assert_eq!(e.stats().pages_used, 0);
    assert_eq!(e.stats().running + e.stats().waiting, 0);
}

#[test]
fn stop_strings_and_stop_tokens_end_requests() {
    let l = loaded::<B>();
    let detok: Arc<dyn stoke_engine::Detokenize> = Arc::new(TokenizerText(l.tokenizer.clone()));
    let p = prompts();
    let run = |params: Params| {
        let mut e = Engine::new(&l.model, config(1, None), Some(detok.clone())).unwrap();
        let (done, events) = drive(&mut e, &p, &[vec![(1, params)]]);
        let text: String = events
            .iter()
            .map(|ev| match ev {
                Event::Token { text, .. } | Event::Finished { text, .. } => text.as_str(),
            })
            .collect();
        (done[&1].clone(), text)
    };
    let ((tokens, reason), text) = run(greedy(4));
    assert_eq!(reason, FinishReason::MaxTokens);
    assert_eq!(text, l.tokenizer.decode(&tokens, false).unwrap());
    // A stop string from the middle of that text: the text stops before it.
    let chars: Vec<char> = text.chars().collect();
    let cut = chars.len() / 2;
    let stop: String = chars[cut..cut + 2].iter().collect();
    let first = text.find(&stop).unwrap();
    let ((_, reason), stopped) = run(Params {
        stop: vec![stop.clone()],
        ..greedy(4)
    });
    assert_eq!(reason, FinishReason::StopString(stop));
    assert_eq!(stopped, text[..first]);
    // A stop token: the tokens before it, not it.
    let ((got, reason), _) = run(Params {
        stop_token_ids: vec![tokens[3]],
        ..greedy(4)
    });
    let at = tokens.iter().position(|&t| t == tokens[3]).unwrap();
    assert_eq!(reason, FinishReason::StopToken(tokens[3]));
    assert_eq!(got, tokens[..at]);
}

#[test]
fn log_probabilities_come_with_their_tokens() {
    let l = loaded::<B>();
    let p = prompts();
    let mut e = Engine::new(&l.model, config(2, None), None).unwrap();
    let with = Params {
        logprobs: Some(3),
        ..greedy(2)
    };
    let (done, events) = drive(&mut e, &p, &[vec![(0, with), (1, greedy(1))]]);
    let mut n = 0;
    for ev in &events {
        let Event::Token {
            token, logprobs, ..
        } = ev
        else {
            continue;
        };
        let Some(lp) = logprobs else { continue };
        n += 1;
        assert_eq!(lp.top.len(), 3);
        // Greedy: the chosen token is the most likely one.
        assert_eq!(lp.top[0].0, *token);
        assert!((lp.top[0].1 - lp.logprob).abs() < 1e-6);
        assert!(lp.top.windows(2).all(|w| w[0].1 >= w[1].1));
        assert!(lp.top.iter().map(|t| t.1.exp()).sum::<f32>() <= 1.0 + 1e-5);
    }
    assert_eq!(n, done[&0].0.len(), "every token of the request that asked");
    let others = events
        .iter()
        .filter(|ev| matches!(ev, Event::Token { logprobs: None, .. }))
        .count();
    assert_eq!(others, done[&1].0.len());
}

#[test]
fn bad_requests_get_typed_errors() {
    let l = loaded::<B>();
    let mut e = Engine::new(&l.model, config(2, Some(9)), None).unwrap();
    let err = |r: Result<RequestId, EngineError>| r.unwrap_err();
    match err(e.add(
        vec![1, 2],
        Params {
            top_p: 1.5,
            ..Params::default()
        },
    )) {
        EngineError::Param(p) => assert_eq!(p.field, "top_p"),
        other => panic!("{other}"),
    }
    match err(e.add(
        vec![1, 2],
        Params {
            repetition_penalty: 0.0,
            ..Params::default()
        },
    )) {
        EngineError::Param(p) => assert_eq!(p.field, "repetition_penalty"),
        other => panic!("{other}"),
    }
    assert!(matches!(
        err(e.add(vec![], Params::default())),
        EngineError::EmptyPrompt
    ));
    assert!(matches!(
        err(e.add(vec![PACKABLE.vocab as u32], Params::default())),
        EngineError::Token { .. }
    ));
    assert!(matches!(
        err(e.add(vec![1; 150], Params::greedy(20))),
        EngineError::TooLong {
            prompt: 150,
            max_tokens: 20,
            context: 160
        }
    ));
    // 8 usable pages of 16: 140 tokens need 9.
    assert!(matches!(
        err(e.add(vec![1; 100], Params::greedy(40))),
        EngineError::TooLarge { needed: 9, .. }
    ));
    assert!(matches!(
        err(e.add(
            vec![1],
            Params {
                stop: vec!["x".into()],
                ..Params::default()
            }
        )),
        EngineError::NoDetokenizer
    ));
    let mut small = config(1, None);
    small.max_waiting = 1;
    let mut e = Engine::new(&l.model, small, None).unwrap();
    e.add(vec![1], Params::default()).unwrap();
    assert!(matches!(
        err(e.add(vec![1], Params::default())),
        EngineError::QueueFull { waiting: 1 }
    ));
}

#[test]
fn two_models_with_different_plans_live_in_one_process() {
    // One set of weights prepared twice: a BF16 KV cache, and an INT4 one (each model's plan;
    // the engines take their decoders' formats from it). Their engines step in turn, each
    // giving the tokens it gives alone.
    let l = loaded::<stoke::Stoke<B>>();
    let plan = |kv_format| stoke::Plan {
        kv_format,
        ..Default::default()
    };
    let a = l.model.clone().prepared(plan(stoke::KvCacheFormat::Bf16));
    let b = l.model.clone().prepared(plan(stoke::KvCacheFormat::Int4));
    let p = prompts();
    let arrivals =
        || -> Vec<Vec<(usize, Params)>> { vec![(0..p.len()).map(|i| (i, greedy(i))).collect()] };
    let alone = |m: &Llama<stoke::Stoke<B>>| {
        let mut e = Engine::new(m, config(3, None), None).unwrap();
        let mut index = HashMap::new();
        for (i, par) in arrivals().remove(0) {
            index.insert(e.add(p[i].clone(), par).unwrap(), i);
        }
        let mut got: HashMap<usize, Vec<u32>> = HashMap::new();
        while e.has_work() {
            for ev in e.step().unwrap() {
                if let Event::Token { id, token, .. } = ev {
                    got.entry(index[&id]).or_default().push(token);
                }
            }
        }
        got
    };
    let (want_a, want_b) = (alone(&a), alone(&b));
    assert_ne!(want_a, want_b, "the plans compute the same");
    let mut ea = Engine::new(&a, config(3, None), None).unwrap();
    let mut eb = Engine::new(&b, config(3, None), None).unwrap();
    let (mut ia, mut ib) = (HashMap::new(), HashMap::new());
    for (i, par) in arrivals().remove(0) {
        ia.insert(ea.add(p[i].clone(), par.clone()).unwrap(), i);
        ib.insert(eb.add(p[i].clone(), par).unwrap(), i);
    }
    let (mut got_a, mut got_b): (HashMap<usize, Vec<u32>>, HashMap<usize, Vec<u32>>) =
        Default::default();
    while ea.has_work() || eb.has_work() {
        for (e, index, got) in [(&mut ea, &ia, &mut got_a), (&mut eb, &ib, &mut got_b)] {
            if !e.has_work() {
                continue;
            }
            for ev in e.step().unwrap() {
                if let Event::Token { id, token, .. } = ev {
                    got.entry(index[&id]).or_default().push(token);
                }
            }
        }
    }
    assert_eq!(got_a, want_a);
    assert_eq!(got_b, want_b);
}
