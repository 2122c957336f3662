//! Reads a Piper `.onnx` export into a name -> [`Tensor`] map, plus the few node
//! attributes (conv dilations/pads/strides/groups, leaky-relu slopes) that the
//! hyper-parameters are derived from.
//!
//! Most initializers are already named after the PyTorch module that owns them
//! (`enc_p.encoder.attn_layers.0.conv_q.weight`, ...). The exporter gave a few
//! others a generic name; they are renamed here through the node that consumes them:
//! * the weight-normed WaveNet convs of the flow become `onnx::Conv_8168` etc.;
//!   their consumer is e.g. `/flow/flows.6/enc/in_layers.0/Conv`, so the weight
//!   becomes `flow.flows.6.enc.in_layers.0.weight` (input 1) and a bias would
//!   become `...bias` (input 2). The weight norm is already folded into them.
//! * the text embedding `enc_p.emb.weight` was exported as `sid` (consumer
//!   `/enc_p/emb/Gather`), it becomes `enc_p.emb.weight`.
//!
//! Original names stay available too. Constant-folded values (e.g.
//! `/dp/flows.0/Exp_output_0` = exp(-logs) of the duration predictor's
//! `ElementwiseAffine`) keep their graph names; [`OnnxWeights::node_initializer`]
//! finds them through their consumer node.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use candle_core::{Device, Tensor};
use candle_onnx::onnx;

use crate::models::{ModelError, Result};

/// The attributes of one `Conv` / `ConvTranspose` node.
#[derive(Debug, Clone, PartialEq)]
pub struct ConvAttrs {
    pub op_type: String,
    pub kernel: usize,
    pub dilation: usize,
    pub stride: usize,
    pub group: usize,
    pub pad_left: usize,
    pub pad_right: usize,
}

/// One graph node, reduced to what the loader looks at.
#[derive(Debug, Clone)]
pub struct NodeInfo {
    pub name: String,
    pub op_type: String,
    pub inputs: Vec<String>,
    pub outputs: Vec<String>,
    /// Float attributes (e.g. `alpha` of LeakyRelu).
    pub floats: HashMap<String, f32>,
    /// Integer and integer-list attributes.
    pub ints: HashMap<String, Vec<i64>>,
}

/// All float initializers of the graph plus node info.
pub struct OnnxWeights {
    path: PathBuf,
    tensors: HashMap<String, Tensor>,
    nodes: Vec<NodeInfo>,
    node_by_name: HashMap<String, usize>,
    /// Module path ("dec.resblocks.0.convs.1") -> conv attributes.
    convs: HashMap<String, ConvAttrs>,
}

/// `/dec/resblocks.0/convs.1/Conv` -> `dec.resblocks.0.convs.1`.
pub fn module_of_node(node_name: &str) -> Option<String> {
    let trimmed = node_name.strip_prefix('/')?;
    let (module, _op) = trimmed.rsplit_once('/')?;
    if module.is_empty() {
        return None;
    }
    Some(module.replace('/', "."))
}

fn format_err(path: &Path, msg: impl Into<String>) -> ModelError {
    ModelError::Format {
        path: path.to_path_buf(),
        msg: msg.into(),
    }
}

/// A FLOAT TensorProto -> Tensor (raw little-endian bytes or `float_data`).
fn tensor_from_proto(path: &Path, t: &onnx::TensorProto, device: &Device) -> Result<Tensor> {
    const FLOAT: i32 = 1;
    if t.data_type != FLOAT {
        return Err(format_err(
            path,
            format!(
                "initializer {} has data type {}, not float",
                t.name, t.data_type
            ),
        ));
    }
    if t.data_location != 0 || !t.external_data.is_empty() {
        return Err(format_err(
            path,
            format!(
                "initializer {} uses external data, which is not supported",
                t.name
            ),
        ));
    }
    let mut dims = Vec::with_capacity(t.dims.len());
    for &d in &t.dims {
        let d = usize::try_from(d)
            .map_err(|_| format_err(path, format!("initializer {}: negative dim {d}", t.name)))?;
        dims.push(d);
    }
    let numel: usize = dims.iter().product();
    let data: Vec<f32> = if !t.float_data.is_empty() {
        t.float_data.clone()
    } else {
        if t.raw_data.len() != numel * 4 {
            return Err(format_err(
                path,
                format!(
                    "initializer {}: {} bytes of data for {numel} floats",
                    t.name,
                    t.raw_data.len()
                ),
            ));
        }
        let mut v = vec![0f32; numel];
        for (o, b) in v.iter_mut().zip(t.raw_data.chunks_exact(4)) {
            let mut bytes = [0u8; 4];
            bytes.copy_from_slice(b);
            *o = f32::from_le_bytes(bytes);
        }
        v
    };
    if data.len() != numel {
        return Err(format_err(
            path,
            format!(
                "initializer {}: {} values for shape {dims:?}",
                t.name,
                data.len()
            ),
        ));
    }
    Ok(Tensor::from_vec(data, dims, device)?)
}

impl OnnxWeights {
    pub fn load(path: &Path, device: &Device) -> Result<Self> {
        if !path.exists() {
            return Err(ModelError::Io {
                path: path.to_path_buf(),
                source: std::io::Error::new(std::io::ErrorKind::NotFound, "no such file"),
            });
        }
        let model = candle_onnx::read_file(path).map_err(|e| format_err(path, e.to_string()))?;
        let graph = model
            .graph
            .as_ref()
            .ok_or_else(|| format_err(path, "the model has no graph"))?;

        let mut nodes = Vec::with_capacity(graph.node.len());
        let mut node_by_name = HashMap::new();
        for n in &graph.node {
            let mut floats = HashMap::new();
            let mut ints = HashMap::new();
            for a in &n.attribute {
                // AttributeType: FLOAT = 1, INT = 2, FLOATS = 6, INTS = 7.
                match a.r#type {
                    1 => {
                        floats.insert(a.name.clone(), a.f);
                    }
                    2 => {
                        ints.insert(a.name.clone(), vec![a.i]);
                    }
                    7 => {
                        ints.insert(a.name.clone(), a.ints.clone());
                    }
                    _ => {}
                }
            }
            if !n.name.is_empty() {
                node_by_name.insert(n.name.clone(), nodes.len());
            }
            nodes.push(NodeInfo {
                name: n.name.clone(),
                op_type: n.op_type.clone(),
                inputs: n.input.clone(),
                outputs: n.output.clone(),
                floats,
                ints,
            });
        }

        let mut tensors = HashMap::new();
        for t in &graph.initializer {
            // Integer initializers are shape plumbing; only floats are weights.
            if t.data_type != 1 {
                continue;
            }
            let tensor = tensor_from_proto(path, t, device)?;
            tensors.insert(t.name.clone(), tensor);
        }

        // Consumers of each initializer.
        let mut consumers: HashMap<&str, Vec<(usize, usize)>> = HashMap::new();
        for (ni, n) in nodes.iter().enumerate() {
            for (ii, inp) in n.inputs.iter().enumerate() {
                if tensors.contains_key(inp.as_str()) {
                    consumers.entry(inp.as_str()).or_default().push((ni, ii));
                }
            }
        }
        let mut aliases = Vec::new();
        for (name, uses) in &consumers {
            let [(ni, ii)] = uses.as_slice() else {
                continue;
            };
            let node = &nodes[*ni];
            let Some(module) = module_of_node(&node.name) else {
                continue;
            };
            let suffix = match (node.op_type.as_str(), ii) {
                ("Conv" | "ConvTranspose", 1) => "weight",
                ("Conv" | "ConvTranspose", 2) => "bias",
                ("Gather", 0) => "weight",
                _ => continue,
            };
            let canonical = format!("{module}.{suffix}");
            if canonical != *name && !tensors.contains_key(&canonical) {
                aliases.push((canonical, name.to_string()));
            }
        }
        for (canonical, original) in aliases {
            if let Some(t) = tensors.get(&original) {
                let t = t.clone();
                tensors.insert(canonical, t);
            }
        }

        let mut convs = HashMap::new();
        for n in &nodes {
            if n.op_type != "Conv" && n.op_type != "ConvTranspose" {
                continue;
            }
            let Some(module) = module_of_node(&n.name) else {
                continue;
            };
            let one = |key: &str, default: i64| -> Result<usize> {
                let v = match n.ints.get(key) {
                    Some(v) => v.first().copied().unwrap_or(default),
                    None => default,
                };
                usize::try_from(v).map_err(|_| format_err(path, format!("{}: bad {key}", n.name)))
            };
            let kernel = match n.ints.get("kernel_shape").and_then(|v| v.first()) {
                Some(&k) => usize::try_from(k)
                    .map_err(|_| format_err(path, format!("{}: bad kernel", n.name)))?,
                None => {
                    // Read it off the weight.
                    let w = n.inputs.get(1).and_then(|w| tensors.get(w));
                    match w.map(|w| w.dims().to_vec()) {
                        Some(d) if d.len() == 3 => d[2],
                        _ => return Err(format_err(path, format!("{}: no kernel shape", n.name))),
                    }
                }
            };
            let pads = n.ints.get("pads").cloned().unwrap_or_else(|| vec![0, 0]);
            let pad = |i: usize| -> Result<usize> {
                let v = pads.get(i).copied().unwrap_or(0);
                usize::try_from(v).map_err(|_| format_err(path, format!("{}: bad pads", n.name)))
            };
            if n.ints.contains_key("auto_pad") {
                return Err(format_err(
                    path,
                    format!("{}: auto_pad is not supported", n.name),
                ));
            }
            convs.insert(
                module,
                ConvAttrs {
                    op_type: n.op_type.clone(),
                    kernel,
                    dilation: one("dilations", 1)?,
                    stride: one("strides", 1)?,
                    group: one("group", 1)?,
                    pad_left: pad(0)?,
                    pad_right: pad(1)?,
                },
            );
        }

        Ok(Self {
            path: path.to_path_buf(),
            tensors,
            nodes,
            node_by_name,
            convs,
        })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    pub fn contains(&self, name: &str) -> bool {
        self.tensors.contains_key(name)
    }

    /// The tensor called `name` (after renaming), or a Format error.
    pub fn get(&self, name: &str) -> Result<Tensor> {
        self.tensors
            .get(name)
            .cloned()
            .ok_or_else(|| format_err(&self.path, format!("missing weight {name}")))
    }

    /// The tensor called `name`, checked against the expected shape.
    pub fn get_shaped(&self, name: &str, shape: &[usize]) -> Result<Tensor> {
        let t = self.get(name)?;
        if t.dims() != shape {
            return Err(format_err(
                &self.path,
                format!("weight {name} has shape {:?}, expected {shape:?}", t.dims()),
            ));
        }
        Ok(t)
    }

    /// The dims of `name`, or a Format error.
    pub fn dims(&self, name: &str) -> Result<Vec<usize>> {
        Ok(self.get(name)?.dims().to_vec())
    }

    /// How many `{prefix}{i}{suffix}` exist for i = 0, 1, 2, ... (stops at the first gap).
    pub fn count(&self, prefix: &str, suffix: &str) -> usize {
        let mut i = 0;
        while self.contains(&format!("{prefix}{i}{suffix}")) {
            i += 1;
        }
        i
    }

    /// The attributes of the Conv/ConvTranspose node of module `module`.
    pub fn conv_attrs(&self, module: &str) -> Result<&ConvAttrs> {
        self.convs
            .get(module)
            .ok_or_else(|| format_err(&self.path, format!("no conv node for {module}")))
    }

    pub fn node(&self, name: &str) -> Option<&NodeInfo> {
        self.node_by_name.get(name).map(|&i| &self.nodes[i])
    }

    pub fn nodes(&self) -> &[NodeInfo] {
        &self.nodes
    }

    /// The node that consumes the value `value` (first one).
    pub fn consumer_of(&self, value: &str) -> Option<&NodeInfo> {
        self.nodes
            .iter()
            .find(|n| n.inputs.iter().any(|i| i == value))
    }

    /// The first float initializer among the inputs of node `node_name`.
    pub fn node_initializer(&self, node_name: &str) -> Option<(String, Tensor)> {
        let node = self.node(node_name)?;
        node.inputs
            .iter()
            .find_map(|i| self.tensors.get(i).map(|t| (i.clone(), t.clone())))
    }

    /// A scalar float initializer among the inputs of node `node_name`.
    pub fn node_scalar(&self, node_name: &str) -> Option<f32> {
        let (_, t) = self.node_initializer(node_name)?;
        if t.elem_count() != 1 {
            return None;
        }
        t.flatten_all()
            .ok()?
            .to_vec1::<f32>()
            .ok()?
            .first()
            .copied()
    }
}
