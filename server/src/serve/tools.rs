//! The tools a client offers, validated the same way for Chat Completions
//! (`{"type": "function", "function": {...}}`) and Realtime (`{"type":
//! "function", "name", ...}`), into the engine's one shape.

use std::sync::Arc;

use serde_json::{json, Map, Value};

use omnistream_stages::engine::{ToolCall, ToolChoice, Tools};

use super::error::ClientError;

/// Most tools one request may offer (OpenAI's limit).
pub const MAX_TOOLS: usize = 128;
/// Most bytes of tool definitions (they all go into the prompt).
const MAX_TOOLS_BYTES: usize = 64 * 1024;

/// Where the tools come from: each API nests them its own way.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Shape {
    Chat,
    Realtime,
}

/// The offered tools and the choice, as a client set them (`choice: None`
/// is `"none"`: no tool may be called).
#[derive(Debug, Clone, PartialEq)]
pub struct Offer {
    /// Chat Completions shape.
    pub functions: Vec<Value>,
    pub choice: Option<ToolChoice>,
}

impl Offer {
    /// No tools yet; the model chooses once there are (OpenAI's default).
    pub fn auto() -> Self {
        Self {
            functions: Vec::new(),
            choice: Some(ToolChoice::Auto),
        }
    }

    /// What the engine gets: nothing when no tool may be called.
    pub fn tools(&self) -> Option<Arc<Tools>> {
        match (&self.choice, self.functions.is_empty()) {
            (Some(choice), false) => Some(Arc::new(Tools {
                functions: self.functions.clone(),
                choice: choice.clone(),
            })),
            _ => None,
        }
    }

    /// The tools in `shape` (echoed in Realtime's session).
    pub fn functions_json(&self, shape: Shape) -> Value {
        Value::Array(match shape {
            Shape::Chat => self.functions.clone(),
            Shape::Realtime => self
                .functions
                .iter()
                .map(|f| {
                    let mut o = f.get("function").cloned().unwrap_or(Value::Null);
                    if let Value::Object(m) = &mut o {
                        m.insert("type".into(), json!("function"));
                    }
                    o
                })
                .collect(),
        })
    }

    /// The choice in `shape`.
    pub fn choice_json(&self, shape: Shape) -> Value {
        match &self.choice {
            None => json!("none"),
            Some(ToolChoice::Auto) => json!("auto"),
            Some(ToolChoice::Required) => json!("required"),
            Some(ToolChoice::Function(n)) => match shape {
                Shape::Chat => json!({"type": "function", "function": {"name": n}}),
                Shape::Realtime => json!({"type": "function", "name": n}),
            },
        }
    }
}

/// Validates `tools` (an array in `shape`) and `tool_choice`; `current` is
/// what they change (a session's), `params` the fields' names for errors.
pub fn parse(
    tools: Option<&Value>,
    choice: Option<&Value>,
    current: &Offer,
    shape: Shape,
    params: (&'static str, &'static str),
) -> Result<Offer, ClientError> {
    let (tools_param, choice_param) = params;
    let functions = match tools {
        None => current.functions.clone(),
        Some(v) => parse_functions(v, shape, tools_param)?,
    };
    let choice = match choice {
        None => current.choice.clone(),
        Some(c) => parse_choice(c, shape, choice_param)?,
    };
    if let Some(ToolChoice::Function(n)) = &choice {
        if !functions.iter().any(|f| function_name(f) == Some(n)) {
            return Err(ClientError::param(
                choice_param,
                format!("tool_choice names {n:?}, which is not among the tools"),
            ));
        }
    }
    if choice == Some(ToolChoice::Required) && functions.is_empty() {
        return Err(ClientError::param(
            choice_param,
            "tool_choice \"required\" needs at least one tool",
        ));
    }
    Ok(Offer { functions, choice })
}

fn function_name(f: &Value) -> Option<&str> {
    f.pointer("/function/name").and_then(Value::as_str)
}

fn parse_functions(
    v: &Value,
    shape: Shape,
    param: &'static str,
) -> Result<Vec<Value>, ClientError> {
    let bad = |m: String| ClientError::param(param, m);
    let Value::Array(list) = v else {
        return Err(bad("tools must be an array".into()));
    };
    if list.len() > MAX_TOOLS {
        return Err(bad(format!(
            "at most {MAX_TOOLS} tools, got {}",
            list.len()
        )));
    }
    if v.to_string().len() > MAX_TOOLS_BYTES {
        return Err(bad(format!(
            "the tools' definitions are over {MAX_TOOLS_BYTES} bytes"
        )));
    }
    let mut out: Vec<Value> = Vec::with_capacity(list.len());
    for (i, t) in list.iter().enumerate() {
        let kind = t.get("type").and_then(Value::as_str);
        if kind != Some("function") {
            return Err(bad(format!(
                "tools[{i}]: type {kind:?} is not supported: only \"function\" tools"
            )));
        }
        let f = match shape {
            Shape::Chat => t
                .get("function")
                .ok_or_else(|| bad(format!("tools[{i}]: a function tool needs `function`")))?,
            Shape::Realtime => t,
        };
        let name = f.get("name").and_then(Value::as_str).unwrap_or_default();
        let valid_name = (1..=64).contains(&name.len())
            && name
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-');
        if !valid_name {
            return Err(bad(format!(
                "tools[{i}]: the name {name:?} must be 1 to 64 of a-z, A-Z, 0-9, _ and -"
            )));
        }
        if out.iter().any(|o| function_name(o) == Some(name)) {
            return Err(bad(format!("tools[{i}]: the name {name:?} is used twice")));
        }
        let mut function = Map::new();
        function.insert("name".into(), json!(name));
        match f.get("description") {
            None | Some(Value::Null) => {}
            Some(d @ Value::String(_)) => {
                function.insert("description".into(), d.clone());
            }
            Some(_) => return Err(bad(format!("tools[{i}]: description must be a string"))),
        }
        match f.get("parameters") {
            None | Some(Value::Null) => {}
            Some(p @ Value::Object(_)) => {
                function.insert("parameters".into(), p.clone());
            }
            Some(_) => {
                return Err(bad(format!(
                    "tools[{i}]: parameters must be a JSON Schema object"
                )))
            }
        }
        out.push(json!({"type": "function", "function": function}));
    }
    Ok(out)
}

fn parse_choice(
    c: &Value,
    shape: Shape,
    param: &'static str,
) -> Result<Option<ToolChoice>, ClientError> {
    let named = match shape {
        Shape::Chat => c.pointer("/function/name"),
        Shape::Realtime => c.get("name"),
    };
    match (c, named.and_then(Value::as_str)) {
        (Value::String(s), _) => match s.as_str() {
            "none" => Ok(None),
            "auto" => Ok(Some(ToolChoice::Auto)),
            "required" => Ok(Some(ToolChoice::Required)),
            other => Err(ClientError::param(
                param,
                format!("tool_choice {other:?}: use \"none\", \"auto\", \"required\" or a function"),
            )),
        },
        (Value::Object(o), Some(name)) if o.get("type").and_then(Value::as_str) == Some("function") => {
            Ok(Some(ToolChoice::Function(name.to_string())))
        }
        _ => Err(ClientError::param(
            param,
            match shape {
                Shape::Chat => "tool_choice must be a string or {\"type\": \"function\", \"function\": {\"name\"}}",
                Shape::Realtime => "tool_choice must be a string or {\"type\": \"function\", \"name\"}",
            },
        )),
    }
}

/// A client's function call (an assistant turn's `tool_calls[i]` in Chat
/// Completions, or a Realtime `function_call` item): id, name, arguments.
pub fn client_call(
    id: Option<&str>,
    name: Option<&str>,
    arguments: Option<&Value>,
    param: &'static str,
) -> Result<ToolCall, ClientError> {
    let bad = |m: &str| ClientError::param(param, m.to_string());
    let id = id
        .filter(|s| !s.is_empty() && s.len() <= 64)
        .ok_or_else(|| bad("a function call needs its id (1 to 64 characters)"))?;
    let name = name
        .filter(|s| !s.is_empty())
        .ok_or_else(|| bad("a function call needs its name"))?;
    let arguments = match arguments {
        None | Some(Value::Null) => "{}".to_string(),
        Some(Value::String(s)) => s.clone(),
        Some(o @ Value::Object(_)) => o.to_string(),
        Some(_) => return Err(bad("a function call's arguments must be a JSON string")),
    };
    let mut call = ToolCall::new(name, arguments);
    call.id = id.to_string();
    Ok(call)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn chat_tool(name: &str) -> Value {
        json!({"type": "function", "function": {"name": name, "parameters": {"type": "object"}}})
    }

    #[test]
    fn both_shapes_become_one_and_echo_back() {
        let rt = json!([{"type": "function", "name": "get_weather", "description": "d", "parameters": {"type": "object"}}]);
        let o = parse(
            Some(&rt),
            None,
            &Offer::auto(),
            Shape::Realtime,
            ("tools", "tool_choice"),
        )
        .unwrap();
        assert_eq!(o.choice, Some(ToolChoice::Auto));
        assert_eq!(o.functions[0]["function"]["name"], "get_weather");
        assert_eq!(o.functions_json(Shape::Realtime), rt);
        let c = json!([chat_tool("get_weather")]);
        let o2 = parse(
            Some(&c),
            Some(&json!({"type": "function", "function": {"name": "get_weather"}})),
            &Offer::auto(),
            Shape::Chat,
            ("tools", "tool_choice"),
        )
        .unwrap();
        assert_eq!(o2.choice, Some(ToolChoice::Function("get_weather".into())));
        assert_eq!(
            o2.choice_json(Shape::Realtime),
            json!({"type": "function", "name": "get_weather"})
        );
        // "none" keeps the tools but offers none to the model.
        let o3 = parse(
            None,
            Some(&json!("none")),
            &o2,
            Shape::Chat,
            ("tools", "tool_choice"),
        )
        .unwrap();
        assert!(o3.tools().is_none());
        assert_eq!(o3.functions.len(), 1);
    }

    #[test]
    fn malformed_tools_and_choices_name_their_param() {
        let p = ("session.tools", "session.tool_choice");
        for (tools, choice) in [
            (json!({"type": "function"}), None),
            (json!([{"type": "code_interpreter"}]), None),
            (json!([{"type": "function", "name": "has space"}]), None),
            (
                json!([{"type": "function", "name": "a"}, {"type": "function", "name": "a"}]),
                None,
            ),
            (
                json!([{"type": "function", "name": "a", "parameters": "x"}]),
                None,
            ),
            (
                json!([{"type": "function", "name": "a", "description": 3}]),
                None,
            ),
            (
                json!([{"type": "function", "name": "a"}]),
                Some(json!("sometimes")),
            ),
            (
                json!([{"type": "function", "name": "a"}]),
                Some(json!({"type": "function", "name": "b"})),
            ),
            (json!([]), Some(json!("required"))),
        ] {
            let e = parse(
                Some(&tools),
                choice.as_ref(),
                &Offer::auto(),
                Shape::Realtime,
                p,
            )
            .unwrap_err();
            assert!(
                e.param == Some(p.0) || e.param == Some(p.1),
                "{tools} {choice:?}: {e:?}"
            );
        }
        let many = Value::Array(
            (0..=MAX_TOOLS)
                .map(|i| json!({"type": "function", "name": format!("f{i}")}))
                .collect(),
        );
        assert!(parse(Some(&many), None, &Offer::auto(), Shape::Realtime, p).is_err());
    }
}
