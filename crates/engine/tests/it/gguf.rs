//! GGUF: values and tensors written by a small writer read back exactly; malformed files give
//! typed errors and never panic, nor do odd metadata values in the model and tokenizer.

use engine::EngineError;
use engine::gguf::{DType, Gguf, Value};
use half::{bf16, f16};
use proptest::prelude::*;

/// A minimal GGUF v3 writer: metadata entries and tensors, data aligned to 32.
#[derive(Default)]
struct Writer {
    kv: Vec<u8>,
    n_kv: u64,
    tensors: Vec<(String, Vec<u64>, u32, Vec<u8>)>,
}

fn string(out: &mut Vec<u8>, s: &str) {
    out.extend((s.len() as u64).to_le_bytes());
    out.extend(s.as_bytes());
}

impl Writer {
    fn kv(mut self, key: &str, t: u32, value: &[u8]) -> Self {
        string(&mut self.kv, key);
        self.kv.extend(t.to_le_bytes());
        self.kv.extend(value);
        self.n_kv += 1;
        self
    }

    fn tensor(mut self, name: &str, dims: &[u64], t: u32, data: Vec<u8>) -> Self {
        self.tensors.push((name.to_owned(), dims.to_vec(), t, data));
        self
    }

    fn bytes(&self) -> Vec<u8> {
        let mut out = b"GGUF".to_vec();
        out.extend(3u32.to_le_bytes());
        out.extend((self.tensors.len() as u64).to_le_bytes());
        out.extend(self.n_kv.to_le_bytes());
        out.extend(&self.kv);
        let mut offset = 0u64;
        for (name, dims, t, data) in &self.tensors {
            string(&mut out, name);
            out.extend((dims.len() as u32).to_le_bytes());
            for d in dims {
                out.extend(d.to_le_bytes());
            }
            out.extend(t.to_le_bytes());
            out.extend(offset.to_le_bytes());
            offset += (data.len() as u64).div_ceil(32) * 32;
        }
        out.resize(out.len().div_ceil(32) * 32, 0);
        for (_, _, _, data) in &self.tensors {
            out.extend(data);
            out.resize(out.len().div_ceil(32) * 32, 0);
        }
        out
    }
}

/// A file with one value of every metadata type and one tensor of every element type, and the
/// values each tensor must dequantize to.
/// A tensor's name, type and expected values.
type Expected = (&'static str, DType, Vec<f32>);

fn sample() -> (Vec<u8>, Vec<Expected>) {
    let mut arr = 4u32.to_le_bytes().to_vec();
    arr.extend(3u64.to_le_bytes());
    for x in [7u32, 8, 9] {
        arr.extend(x.to_le_bytes());
    }
    let mut s = Vec::new();
    string(&mut s, "llama");
    let w = Writer::default()
        .kv("u8", 0, &[200])
        .kv("i8", 1, &[0xfe])
        .kv("u16", 2, &60000u16.to_le_bytes())
        .kv("i16", 3, &(-300i16).to_le_bytes())
        .kv("u32", 4, &70000u32.to_le_bytes())
        .kv("i32", 5, &(-70000i32).to_le_bytes())
        .kv("f32", 6, &1.5f32.to_le_bytes())
        .kv("bool", 7, &[1])
        .kv("general.architecture", 8, &s)
        .kv("arr", 9, &arr)
        .kv("u64", 10, &(1u64 << 40).to_le_bytes())
        .kv("i64", 11, &(-5i64).to_le_bytes())
        .kv("f64", 12, &0.25f64.to_le_bytes());
    // 64 elements of each type: two rows of 32.
    let vals: Vec<f32> = (0..64).map(|i| (i as f32 - 20.0) / 8.0).collect();
    let mut expect = Vec::new();
    let f32s: Vec<u8> = vals.iter().flat_map(|x| x.to_le_bytes()).collect();
    expect.push(("t.f32", DType::F32, vals.clone()));
    let f16s: Vec<u8> = vals
        .iter()
        .flat_map(|&x| f16::from_f32(x).to_le_bytes())
        .collect();
    expect.push(("t.f16", DType::F16, vals.clone()));
    let bf16s: Vec<u8> = vals
        .iter()
        .flat_map(|&x| bf16::from_f32(x).to_le_bytes())
        .collect();
    expect.push(("t.bf16", DType::BF16, vals));
    // Quantized blocks with scales that make every value exact.
    let (mut q8, mut q8v) = (Vec::new(), Vec::new());
    let (mut q40, mut q40v) = (Vec::new(), Vec::new());
    let (mut q41, mut q41v) = (Vec::new(), Vec::new());
    for b in 0..2 {
        let d = 0.5 * (b + 1) as f32;
        q8.extend(f16::from_f32(d).to_le_bytes());
        for i in 0..32 {
            let q = (i as i8 - 16) * (b as i8 * 2 + 1);
            q8.push(q as u8);
            q8v.push(d * f32::from(q));
        }
        q40.extend(f16::from_f32(d).to_le_bytes());
        q41.extend(f16::from_f32(d).to_le_bytes());
        q41.extend(f16::from_f32(-1.0).to_le_bytes());
        let nib = |i: usize| ((i * 7 + b) % 16) as u8;
        let (mut lo, mut hi) = (Vec::new(), Vec::new());
        let (mut lo1, mut hi1) = (Vec::new(), Vec::new());
        for i in 0..16 {
            q40.push(nib(i) | (nib(i + 16) << 4));
            q41.push(nib(i) | (nib(i + 16) << 4));
            lo.push(d * (f32::from(nib(i)) - 8.0));
            hi.push(d * (f32::from(nib(i + 16)) - 8.0));
            lo1.push(d * f32::from(nib(i)) - 1.0);
            hi1.push(d * f32::from(nib(i + 16)) - 1.0);
        }
        q40v.extend(lo.into_iter().chain(hi));
        q41v.extend(lo1.into_iter().chain(hi1));
    }
    expect.push(("t.q8_0", DType::Q8_0, q8v));
    expect.push(("t.q4_0", DType::Q4_0, q40v));
    expect.push(("t.q4_1", DType::Q4_1, q41v));
    let w = w
        .tensor("t.f32", &[32, 2], 0, f32s)
        .tensor("t.f16", &[32, 2], 1, f16s)
        .tensor("t.bf16", &[32, 2], 30, bf16s)
        .tensor("t.q8_0", &[32, 2], 8, q8)
        .tensor("t.q4_0", &[32, 2], 2, q40)
        .tensor("t.q4_1", &[32, 2], 3, q41);
    (w.bytes(), expect)
}

#[test]
fn every_value_and_tensor_type_reads_back() {
    let (bytes, expect) = sample();
    let g = Gguf::from_bytes(bytes).expect("a valid file");
    let m = &g.metadata;
    assert_eq!(m["u8"], Value::U64(200));
    assert_eq!(m["i8"], Value::I64(-2));
    assert_eq!(m["u16"], Value::U64(60000));
    assert_eq!(m["i16"], Value::I64(-300));
    assert_eq!(m["u32"], Value::U64(70000));
    assert_eq!(m["i32"], Value::I64(-70000));
    assert_eq!(m["f32"], Value::F64(1.5));
    assert_eq!(m["bool"], Value::Bool(true));
    assert_eq!(m["general.architecture"].as_str(), Some("llama"));
    assert_eq!(
        m["arr"],
        Value::Array(vec![Value::U64(7), Value::U64(8), Value::U64(9)])
    );
    assert_eq!(m["u64"].as_u64(), Some(1 << 40));
    assert_eq!(m["i64"], Value::I64(-5));
    assert_eq!(m["f64"].as_f64(), Some(0.25));
    for (name, dtype, want) in expect {
        let t = g.tensor(name).expect("present");
        assert_eq!((t.dtype, t.dims.as_slice()), (dtype, &[32usize, 2][..]));
        assert_eq!(g.dequantize(name).expect("present"), want, "{name}");
    }
}

/// A sample file changed by `edit` must fail with an error whose text holds `want`.
fn check(edit: impl FnOnce(&mut Vec<u8>), want: &str) {
    let (mut bytes, _) = sample();
    edit(&mut bytes);
    match Gguf::from_bytes(bytes) {
        Ok(_) => panic!("accepted a file that should fail with {want:?}"),
        Err(e) => assert!(e.to_string().contains(want), "{e} lacks {want:?}"),
    }
}

#[test]
fn malformed_files_give_typed_errors() {
    check(|b| b[0] = b'X', "bad magic");
    check(|b| b[4] = 1, "GGUF version 1");
    check(
        |b| b[8..16].copy_from_slice(&u64::MAX.to_le_bytes()),
        "tensor count",
    );
    check(
        |b| b[16..24].copy_from_slice(&(1u64 << 40).to_le_bytes()),
        "metadata count",
    );
    // The first key's length.
    check(
        |b| b[24..32].copy_from_slice(&(1u64 << 50).to_le_bytes()),
        "metadata key",
    );
    // The first key's value type.
    check(
        |b| b[34..38].copy_from_slice(&99u32.to_le_bytes()),
        "metadata value type 99",
    );
    // Shorter files: every truncation point fails cleanly.
    let (full, _) = sample();
    let last = Gguf::from_bytes(full.clone())
        .expect("valid")
        .tensor("t.q4_1")
        .expect("present")
        .range
        .end;
    for cut in [3, 10, 30, 200, full.len() / 2, last - 1] {
        let e = Gguf::from_bytes(full[..cut].to_vec()).expect_err("truncated");
        assert!(matches!(
            e,
            EngineError::Malformed(_) | EngineError::Unsupported(_)
        ));
    }
    // The last tensor's type and offset fields: find the tensor directory by its last name.
    let at = |b: &Vec<u8>| {
        let name = b"t.q4_1";
        b.windows(name.len())
            .rposition(|w| w == name)
            .expect("present")
            + name.len()
    };
    check(
        |b| {
            let i = at(b);
            b[i..i + 4].copy_from_slice(&5u32.to_le_bytes());
        },
        "rank 5",
    );
    check(
        |b| {
            let i = at(b) + 4;
            b[i..i + 8].copy_from_slice(&0u64.to_le_bytes());
        },
        "dimensions",
    );
    check(
        |b| {
            let i = at(b) + 4;
            b[i..i + 8].copy_from_slice(&33u64.to_le_bytes());
        },
        "whole blocks",
    );
    check(
        |b| {
            let i = at(b) + 20;
            b[i..i + 4].copy_from_slice(&14u32.to_le_bytes());
        },
        "ggml type 14",
    );
    check(
        |b| {
            let i = at(b) + 24;
            b[i..i + 8].copy_from_slice(&u64::MAX.to_le_bytes());
        },
        "past the end",
    );
    check(
        |b| {
            let i = at(b) + 24;
            b[i..i + 8].copy_from_slice(&4096u64.to_le_bytes());
        },
        "past the end",
    );
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    /// Random byte changes never panic: the file parses or fails with an error.
    #[test]
    fn corrupted_files_never_panic(edits in proptest::collection::vec((any::<prop::sample::Index>(), any::<u8>()), 1..8)) {
        let (mut bytes, _) = sample();
        for (i, v) in edits {
            let i = i.index(bytes.len());
            bytes[i] = v;
        }
        if let Ok(g) = Gguf::from_bytes(bytes) {
            for name in g.tensors.keys() {
                prop_assert!(g.dequantize(name).is_ok());
            }
        }
    }
}

/// A value an edited file can hold where the model expects another.
fn odd_value(i: usize, len: usize) -> Value {
    match i % 14 {
        0 => Value::U64(0),
        1 => Value::U64(1),
        2 => Value::U64(3),
        3 => Value::U64(1 << 40),
        4 => Value::U64(u64::MAX),
        5 => Value::I64(-1),
        6 => Value::F64(f64::NAN),
        7 => Value::F64(-1.0),
        8 => Value::F64(1e300),
        9 => Value::Bool(true),
        10 => Value::Str("gpt2".into()),
        11 => Value::Array(Vec::new()),
        12 => Value::Array(vec![Value::Str("a".into()); len]),
        _ => Value::Array(vec![Value::U64(u64::MAX); len]),
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    /// A valid file whose metadata values are replaced by odd ones (zero, huge or negative
    /// sizes, NaN, values of another type, arrays of the wrong length): the model and the
    /// tokenizer load and run, or fail with an error, never a panic or an abort.
    #[test]
    fn odd_metadata_loads_or_fails_cleanly(
        edits in proptest::collection::vec((any::<prop::sample::Index>(), 0..14usize, 0..300usize), 0..4),
    ) {
        let mut g = crate::model::tiny(DType::F16);
        let keys: Vec<String> = g.metadata.keys().cloned().collect();
        for (key, v, len) in &edits {
            let key = &keys[key.index(keys.len())];
            g.metadata.insert(key.clone(), odd_value(*v, *len));
        }
        let logits = engine::Model::load(&g).and_then(|model| {
            let mut store = engine::KvStore::<f32>::new(&model.config, 1, 16)?;
            let batch = engine::Batch::single(0, 5, 1);
            let mut attn = engine::DenseAttention { store: &mut store, batch: &batch };
            // Tokens past an edited vocabulary are an error too.
            model.forward(&crate::model::text(5), &[0, 1, 2, 3, 4], &mut attn, &[4])
        });
        let text = engine::Tokenizer::from_gguf(&g).and_then(|tok| {
            let ids = tok.encode("Hello, world: 12345!")?;
            tok.decode(&ids)
        });
        if edits.is_empty() {
            prop_assert!(logits.is_ok_and(|l| l.iter().all(|x| x.is_finite())));
            prop_assert_eq!(text.ok(), Some("Hello, world: 12345!".to_owned()));
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    /// Any text, ASCII or not, control characters and the tokenizer's own special-token
    /// spellings included, decodes back from its encoding to itself.
    #[test]
    fn any_text_round_trips_through_the_tokenizer(
        parts in proptest::collection::vec(
            prop_oneof![
                4 => any::<String>(),
                1 => Just("<|extra_299|>".to_owned()),
                1 => Just(" \n\t  ".to_owned()),
                1 => "[a-z ]{0,12}",
            ],
            0..6,
        ),
    ) {
        let tok = engine::Tokenizer::from_gguf(&crate::model::tiny(DType::F16))
            .expect("the synthetic model's tokenizer");
        let text: String = parts.concat();
        let ids = tok.encode(&text).expect("every text encodes");
        prop_assert_eq!(tok.decode(&ids).expect("its ids decode"), text);
    }
}
